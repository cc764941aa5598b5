"""Sampling on the device, per slot: greedy, temperature, top-k, top-p, min-p, seeded, with
penalties, logit bias, min_tokens and a grammar's token bitmask, inside the decode step.

Order, per row (every control at its default is an exact no-op, so rows without controls
sample exactly what they did before the controls existed):
1. repetition penalty (Hugging Face: a seen token's logit is divided by p if positive,
   multiplied by p if not) over the row's recent distinct prompt and output tokens, then
   presence and frequency penalties (OpenAI: minus presence if the token is in the output,
   minus frequency x its count) over the output;
2. logit_bias added (-inf bans);
3. EOS and stop ids banned while the row has fewer than min_tokens outputs, and tokens
   outside the grammar bitmask banned (if the two together would ban everything, the
   min_tokens ban yields to the grammar);
4. greedy rows take the argmax; sampled rows divide by the temperature, keep tokens with
   probability >= min_p x the top probability, then top-k and top-p, and draw.
Logprobs are those of the model's raw logits (before any of the above).

Each slot's randomness is a function of its own request seed and how many tokens it has
generated, never of the batch around it: the same seed and prompt give the same tokens
alone or in a full batch, and after a preemption.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The per-row scalar controls this module reads, each with the value at which it is an exact
# no-op. The step batch holds them as one [S, len] float32 array (step_batch.SamplingMetadata,
# read here as `sm.min_p`, ...), and the engine fills a controlled row's from the request's
# SamplingParams field of the same name: a new scalar control is one entry here, used below.
ROW_CONTROLS: dict[str, float] = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def argmax(logits, block: int = 128):
    """First index of the row maximum, in two passes: the maximum of each block of `block`
    logits, then the first block holding the row's maximum and the first index within it.
    One full pass over [S, V] instead of three: at 32 rows x 32,000 on the CPU, 0.34 ms
    against 1.06 for a max and a min over matching indices (and XLA:CPU's own argmax, a
    variadic reduce, is ~4x slower than that). XLA merges the max over the block maxima into a
    second pass over the logits; finding the block by XLA's argmax over the block maxima avoids
    it (0.67x the time at 32 rows) but makes the partitioner all-gather them under tensor
    parallelism. A row holding a NaN gets an unspecified id (XLA:CPU's max does not always
    propagate NaN)."""
    s, v = logits.shape
    nb = -(-v // block)
    x = logits
    if nb * block != v:
        x = jnp.pad(logits, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf)
    x = x.reshape(s, nb, block)
    block_max = jnp.max(x, axis=-1)  # [S, nb]
    m = jnp.max(block_max, axis=-1, keepdims=True)
    ids = jnp.arange(nb, dtype=jnp.int32)
    b = jnp.min(jnp.where(block_max == m, ids, nb), axis=-1)  # nb only if m is a NaN
    inside = jnp.take_along_axis(x, jnp.minimum(b, nb - 1)[:, None, None], axis=1)[:, 0, :]
    j = jnp.min(jnp.where(inside == m, jnp.arange(block, dtype=jnp.int32), block), axis=-1)
    return jnp.where(b < nb, b * block + j, v).astype(jnp.int32)


# Top-k/top-p on the CPU look at each row's largest TOP_CANDIDATES logits first (lax.top_k):
# XLA:CPU sorts a [16, 32,000] block in ~100 ms, and top_k(256) over it takes a few ms.
TOP_CANDIDATES = 256


def _sorted_threshold(logits, k, top_p):
    """Each row's smallest kept logit by a full descending sort (any k, any mass)."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    ranks = jnp.arange(v)[None, :]
    sorted_k = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_k, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each rank
    keep = ((before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (
        ranks < k[:, None]
    )  # p=1: all (float32 sums fall short)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)[:, 0]


def _candidate_threshold(logits, k, top_p):
    """The same threshold from the row's largest TOP_CANDIDATES logits, and whether it is
    exact: the top-k set fits in the candidates, or (no top-k) the candidates hold mass >=
    top_p, normalized over the whole row. Rows that keep every token get -inf."""
    v = logits.shape[-1]
    c = min(TOP_CANDIDATES, v)
    vals, _ = jax.lax.top_k(logits, c)  # [S, c], descending: a sort's first c entries
    ranks = jnp.arange(c)[None, :]
    in_k = ranks < k[:, None]
    # Not vals[:, :1]: a second slice of the top-k makes XLA:CPU sort the whole row instead
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.where(in_k, jnp.exp(vals - top), 0.0)
    total = jnp.where(k <= c, jnp.sum(e, axis=-1), jnp.sum(jnp.exp(logits - top), axis=-1))
    probs = e / total[:, None]
    cum = jnp.cumsum(probs, axis=-1)
    keep = ((cum - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)) & in_k
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(vals, (n_keep - 1)[:, None], axis=-1)[:, 0]
    keeps_all = (k >= v) & (top_p >= 1.0)
    exact = keeps_all | (k <= c) | ((k >= v) & (cum[:, -1] >= top_p))
    return jnp.where(keeps_all, -jnp.inf, threshold), exact


def _filter_top_k_top_p(logits, top_k, top_p):
    """Mask logits outside each row's top-k and top-p set (k=0: off; p=1: off). Ties with the
    smallest kept logit are kept. On the CPU the candidates decide every row they can and a
    sort runs only when one row needs it (a top-k past TOP_CANDIDATES, or a flat row whose
    top-p mass is spread wider); elsewhere the sort always runs (it is cheap there, and a
    cond's predicate would go through the host)."""
    v = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    if jax.default_backend() != "cpu":
        threshold = _sorted_threshold(logits, k, top_p)
    else:
        fast, exact = _candidate_threshold(logits, k, top_p)
        threshold = jax.lax.cond(
            jnp.all(exact), lambda: fast, lambda: jnp.where(exact, fast, _sorted_threshold(logits, k, top_p))
        )
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


def needs_filter(temperature, top_k, top_p, vocab_size: int):
    """Whether any sampled row (temperature > 0) restricts its set by top-k or top-p."""
    return jnp.any((temperature > 0) & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0)))


def unpack_bitmask(bitmask, vocab_size: int):
    """[S, ceil(V/32)] int32 packed bits (bit j of word w = token 32w + j) -> [S, V] bool."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_controls(logits, sm, bitmask=None):
    """Steps 1-3 of the module docstring: the logits greedy rows argmax and sampled rows
    draw from. logits [S, V]; sm a step_batch.SamplingMetadata; bitmask [S, ceil(V/32)]."""
    s, v = logits.shape
    rows = jnp.arange(s)[:, None]
    ids = sm.penalty_ids  # padded with v: gathers clamp, scatters drop
    seen = jnp.take_along_axis(logits, jnp.minimum(ids, v - 1), axis=1)
    rep = sm.repetition_penalty[:, None]
    seen = jnp.where(seen > 0, seen / rep, seen * rep)
    count = sm.penalty_counts.astype(logits.dtype)
    seen = seen - sm.frequency_penalty[:, None] * count - sm.presence_penalty[:, None] * (count > 0)
    logits = logits.at[rows, ids].set(seen, mode="drop")
    logits = logits.at[rows, sm.bias_ids].add(sm.bias_values, mode="drop")
    under_min = (sm.counters < sm.min_tokens)[:, None]
    ban = jnp.zeros((s, v), bool).at[rows, sm.stop_ids].set(True, mode="drop") & under_min
    if bitmask is None:
        return jnp.where(ban, -jnp.inf, logits)
    allowed = unpack_bitmask(bitmask, v)
    keep = allowed & ~ban
    keep = jnp.where(jnp.any(keep, axis=-1, keepdims=True), keep, allowed)
    return jnp.where(keep, logits, -jnp.inf)


def any_controls(sm, bitmask, vocab_size: int):
    """Whether any row has a control `apply_controls` acts on: a penalty or logit-bias id, a
    stop id while under min_tokens, or a bitmask bit cleared. Without one it is an exact
    no-op, and the CPU step skips its passes over [S, V] under a lax.cond (1.4 ms of a
    batch-32 step)."""
    ban = jnp.any((sm.stop_ids < vocab_size) & (sm.counters < sm.min_tokens)[:, None])
    found = jnp.any(sm.penalty_ids < vocab_size) | jnp.any(sm.bias_ids < vocab_size) | ban
    return found if bitmask is None else found | jnp.any(bitmask != -1)


def filter_min_p(scaled, min_p):
    """Keep tokens whose probability is at least min_p times the row's top probability (in log
    space: scaled >= max + log(min_p); min_p = 0 keeps every token)."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    return jnp.where(scaled >= top + jnp.log(min_p)[:, None], scaled, -jnp.inf)


def probs(logits, temperature, top_k, top_p):
    """The distribution a slot samples from: softmax of the temperature-scaled logits
    restricted to its top-k/top-p set. Rows are [N, V]; params are [N]."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    return jax.nn.softmax(_filter_top_k_top_p(logits / t[:, None], top_k, top_p), axis=-1)


def slot_key(seed, counter, tag: int):
    """The key of one draw: a function of the request's seed, its output position and what
    the draw is for, never of the batch."""
    key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), counter)
    return jax.random.fold_in(key, tag)


def sample(logits, sampling, bitmask=None, *, do_sample: bool, num_logprobs: int, argmax_fn=argmax, controls=True):
    """logits [S, V] float32; `sampling` (a step_batch.SamplingMetadata): per-slot
    temperature/top_k/top_p/min_p and the controls of `apply_controls`; seeds uint32 [S, 2]
    and counters int32 [S] make each slot's key; bitmask [S, ceil(V/32)] int32 or None (all
    allowed). Returns (tokens [S], chosen logprob [S], top ids [S, n], top logprobs [S, n])
    with n = num_logprobs (0 for none); logprobs are the raw model's. `argmax_fn` picks greedy
    rows' ids (`argmax` here; the model runner passes the native kernel on the CPU).
    controls=False (static: the host knows no row has one): `apply_controls` is not traced."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    seeds, counters = sampling.seeds, sampling.counters
    raw = logits
    apply = lambda x: apply_controls(x, sampling, bitmask)  # noqa: E731
    if not controls:
        pass
    elif jax.default_backend() == "cpu":  # a GPU cond's predicate goes through the host
        logits = jax.lax.cond(any_controls(sampling, bitmask, logits.shape[-1]), apply, lambda x: x, logits)
    else:
        logits = apply(logits)
    greedy = argmax_fn(logits)
    if do_sample:
        t = jnp.where(temperature > 0, temperature, 1.0)
        scaled = filter_min_p(logits / t[:, None], sampling.min_p)
        if jax.default_backend() == "cpu":  # most requests keep the whole vocabulary: skip the filter
            scaled = jax.lax.cond(
                needs_filter(temperature, top_k, top_p, scaled.shape[-1]),
                lambda x: _filter_top_k_top_p(x, top_k, top_p),
                lambda x: x,
                scaled,
            )
        else:
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)

        def gumbel(seed, counter, row):
            key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), counter)
            return jax.random.gumbel(key, row.shape, row.dtype)

        # jax.random.categorical's own draw (the argmax of logits plus Gumbel noise), with the
        # step's argmax: XLA:CPU's variadic-reduce argmax took 5 of its 7.6 ms at 16 x 32,000.
        sampled = argmax_fn(jax.vmap(gumbel)(seeds, counters, scaled) + scaled)
        tokens = jnp.where(temperature > 0, sampled, greedy)
    else:
        tokens = greedy
    if num_logprobs == 0:
        return tokens, None, None, None
    logp = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, num_logprobs)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
