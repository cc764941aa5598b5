"""Sampling on the device, per slot: greedy, temperature, top-k, top-p, seeded.

Each slot's randomness is a function of its own request seed and how many tokens it has
generated, never of the batch around it: the same seed and prompt give the same tokens
alone or in a full batch, and after a preemption.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax(logits):
    """First index of the row maximum. XLA's CPU argmax (a variadic reduce) is ~4x slower
    than a max followed by a min over matching indices."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    idx = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(logits == m, idx, logits.shape[-1]), axis=-1).astype(jnp.int32)


def _filter_top_k_top_p(logits, top_k, top_p):
    """Mask logits outside each row's top-k and top-p set (k=0: off; p=1: off)."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    ranks = jnp.arange(v)[None, :]
    sorted_k = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_k, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each rank
    keep = (before < top_p[:, None]) & (ranks < k[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


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


def sample(logits, sampling, *, do_sample: bool, num_logprobs: int):
    """logits [S, V] float32; `sampling` (a step_batch.SamplingMetadata): per-slot
    temperature/top_k/top_p [S]; seeds uint32 [S, 2] and counters int32 [S] make each slot's
    key. Returns (tokens [S], chosen logprob [S], top ids [S, n], top logprobs [S, n]) with
    n = num_logprobs (0 for none)."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    seeds, counters = sampling.seeds, sampling.counters
    greedy = argmax(logits)
    if do_sample:
        t = jnp.where(temperature > 0, temperature, 1.0)
        scaled = _filter_top_k_top_p(logits / t[:, None], top_k, top_p)

        def one(seed, counter, row):
            key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), counter)
            return jax.random.categorical(key, row).astype(jnp.int32)

        sampled = jax.vmap(one)(seeds, counters, scaled)
        tokens = jnp.where(temperature > 0, sampled, greedy)
    else:
        tokens = greedy
    if num_logprobs == 0:
        return tokens, None, None, None
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, num_logprobs)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
