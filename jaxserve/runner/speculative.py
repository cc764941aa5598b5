"""Speculative decoding: a proposer guesses k tokens per slot, the target scores all k+1
positions of every slot in one jitted pass, and the rejection rule keeps the output
distribution exactly the target's.

Proposers:
- an EAGLE head (models/eagle.py): one layer over the target's own features, its KV and the
  features in pages of the same ids; it drafts k tokens in one scan, feeding its predicted
  feature back, and the verify pass writes the target's features for the next step;
- a draft model with its own paged KV cache (same page ids as the target's, its own
  arrays), run k+1 steps inside one jitted scan: k proposals, then one more step that only
  writes the last proposal's KV so the draft cache always covers what the target accepts;
- prompt lookup (n-gram), host-side: match the last n tokens earlier in the context and
  propose what followed. It has no q: it is verified as a deterministic proposal (q = 1 at
  the proposed token), which is the same rule.

Acceptance (Leviathan et al.; Chen et al.): accept draft x with probability min(1, p(x)/q(x));
at the first rejection sample from normalize(max(0, p - q)); when all k are accepted sample a
bonus token from p. Greedy slots accept while the draft equals the target's argmax.
Rejected positions need no device rollback: their KV lies beyond the sequence length,
is masked, and is overwritten; the scheduler returns pages past the new length.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import eagle
from jaxserve.runner.sampling import argmax, probs, sample, slot_key
from jaxserve.runner.step_batch import StepBatch
from pallas_kernels.reference import RaggedMetadata

TAG_DRAFT, TAG_ACCEPT, TAG_RESIDUAL = 11, 12, 13


def ngram_propose(tokens: Seq[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the
    longest suffix (n from max_n down to min_n) of `tokens`."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = list(tokens[n_tok - n :])
        for start in range(n_tok - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


def residual(p, q, rejected):
    """What to sample after the accepted drafts: normalize(max(0, p - q)) at a rejection,
    p itself when every draft was accepted (the bonus token)."""
    r = jnp.where(rejected[:, None], jnp.maximum(p - q, 0.0), p)
    return r / jnp.maximum(r.sum(-1, keepdims=True), 1e-30)


def _rows(batch: StepBatch, x):
    """A speculative batch's flat [S * (k + 1)] array as [S, k + 1] (every row spans k + 1 tokens)."""
    return x.reshape(batch.num_rows, -1)


def _draw(logits, sp, i, *, do_sample: bool, argmax_fn=argmax):
    """A proposer's token at draft step i from its logits [S, V']: the argmax for greedy rows,
    a draw from q = probs(logits) for sampling ones. Returns (indices into V' [S], q [S, V'],
    or [S, 0] when no row samples)."""
    if not do_sample:
        return argmax_fn(logits), jnp.zeros((logits.shape[0], 0), jnp.float32)
    q = probs(logits, sp.temperature, sp.top_k, sp.top_p)
    keys = jax.vmap(lambda s, c: slot_key(s, c, TAG_DRAFT))(sp.seeds, sp.counters + i)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, jnp.log(row)))(keys, q).astype(jnp.int32)
    return jnp.where(sp.temperature > 0, drawn, argmax_fn(logits)), q


def draft_propose(graphdef, backend, params, kv, batch: StepBatch, *, do_sample: bool, argmax_fn=argmax):
    """k+1 draft decode steps in one scan over the batch's k+1 positions (the same positions
    and KV slots the target verifies), each a ragged step of one token per row. Returns (kv,
    drafts [S, k], q [S, k, V] or None)."""
    model = nnx.merge(graphdef, params)
    tokens = _rows(batch, batch.tokens)
    k = tokens.shape[1] - 1
    sp, active = batch.sampling, batch.active
    one_per_row = jnp.arange(batch.num_rows + 1, dtype=jnp.int32)

    def step(carry, xs):
        kv, tok = carry
        i, pos, slots = xs
        meta = RaggedMetadata(slots, batch.attn.block_tables, jnp.where(active, pos + 1, 0), one_per_row, pos)
        logits, kv = model(
            tok[:, None], pos[:, None], kv, backend.metadata(meta), backend.forward, logits_index=jnp.zeros_like(tok)
        )
        nxt, q = _draw(logits, sp, i, do_sample=do_sample, argmax_fn=argmax_fn)
        return (kv, nxt), (nxt, q)

    xs = (jnp.arange(k + 1), _rows(batch, batch.positions).T, _rows(batch, batch.attn.slot_mapping).T)
    (kv, _), (drafts, qs) = jax.lax.scan(step, (kv, tokens[:, 0]), xs)
    q = jnp.swapaxes(qs[:k], 0, 1) if do_sample else None
    return kv, jnp.swapaxes(drafts[:k], 0, 1), q


def eagle_fill(graphdef, backend, params, kv, batch: StepBatch, hidden, tokens, *, page_size: int):
    """After a target step over `batch` (prompt chunks, decode rows): write the target's
    features `hidden` [N, H] into the head's feature pages at the tokens' slots, then run the
    head over the same tokens (each reading the feature at its previous position) so its KV
    covers them. Returns the head's pool."""
    head = nnx.merge(graphdef, params)
    layer_kv, (feats,) = kv
    a = batch.attn
    feats = eagle.write_features(feats, hidden, a.slot_mapping)
    slots, valid = eagle.prev_feature_slots(batch.positions, a.query_start_loc, a.block_tables, page_size)
    prev = eagle.gather_features(feats, slots, valid)
    _, layer_kv = head(
        tokens[None],
        batch.positions[None],
        prev[None],
        layer_kv,
        backend.metadata(a),
        backend.forward,
        num_live_tokens=a.query_start_loc[-1],
    )
    return layer_kv, (feats,)


def eagle_write(kv, hidden, slot_mapping):
    """The target's features of a verify pass [N, H] into the head's feature pages."""
    layer_kv, (feats,) = kv
    return layer_kv, (eagle.write_features(feats, hidden, slot_mapping),)


def eagle_propose(
    graphdef, backend, params, kv, batch: StepBatch, *, page_size: int, do_sample: bool, argmax_fn=argmax
):
    """k + 1 steps of the EAGLE head over the rows' k + 1 positions, as draft_propose: step 0
    reads the target's feature at the position before the row's last token (from the pages),
    each later step the head's own predicted feature; each step writes the head's KV at its
    position. Returns (kv, drafts [S, k] as target ids, q [S, k, V] or None): q is the head's
    distribution over its draft vocabulary scattered into the target's."""
    head = nnx.merge(graphdef, params)
    layer_kv, (feats,) = kv
    tokens = _rows(batch, batch.tokens)
    positions = _rows(batch, batch.positions)
    k = tokens.shape[1] - 1
    sp, active = batch.sampling, batch.active
    one_per_row = jnp.arange(batch.num_rows + 1, dtype=jnp.int32)
    d2t = head.d2t[...]
    pos0 = positions[:, 0]
    slots0, valid0 = eagle.prev_feature_slots(pos0, one_per_row, batch.attn.block_tables, page_size)
    f0 = eagle.gather_features(feats, slots0, valid0 & active)
    vocab = head.cfg.layer.vocab_size

    def step(carry, xs):
        layer_kv, tok, f = carry
        i, pos, slots = xs
        meta = RaggedMetadata(slots, batch.attn.block_tables, jnp.where(active, pos + 1, 0), one_per_row, pos)
        g, layer_kv = head(tok[:, None], pos[:, None], f[:, None], layer_kv, backend.metadata(meta), backend.forward)
        g = g[:, 0]
        idx, q = _draw(head.logits(g), sp, i, do_sample=do_sample, argmax_fn=argmax_fn)
        nxt = d2t[idx].astype(jnp.int32)
        if do_sample:  # the draft vocabulary's q, scattered into the target's
            q = jnp.zeros((tok.shape[0], vocab), jnp.float32).at[:, d2t].set(q)
        return (layer_kv, nxt, g.astype(f.dtype)), (nxt, q)

    xs = (jnp.arange(k + 1), positions.T, _rows(batch, batch.attn.slot_mapping).T)
    (layer_kv, _, _), (drafts, qs) = jax.lax.scan(step, (layer_kv, tokens[:, 0], f0), xs)
    q = jnp.swapaxes(qs[:k], 0, 1) if do_sample else None
    return (layer_kv, (feats,)), jnp.swapaxes(drafts[:k], 0, 1).astype(jnp.int32), q


def verify(
    graphdef,
    backend,
    params,
    kv,
    batch: StepBatch,
    drafts,
    draft_q,
    *,
    do_sample: bool,
    with_hidden: bool = False,
    argmax_fn=argmax,
):
    """Score [last, d1..dk] at positions L-1..L-1+k for every slot (rows of k + 1 tokens) and
    apply the acceptance rule. The drafts are `drafts` [S, k] (a draft model's, on the device)
    or, when None, the host's in the rows' tokens[1:], of which batch.num_drafts are real.
    Returns (kv, out_tokens [S, k+1], n_out [S]): the first n_out tokens are emitted (the
    accepted drafts, then the corrected or bonus token); with_hidden, also the target's
    final-norm hidden state at every position [S * (k + 1), H] (an EAGLE head's features)."""
    tokens = _rows(batch, batch.tokens)
    k = tokens.shape[1] - 1
    host_drafts = drafts is None
    if host_drafts:
        drafts, num_drafts = tokens[:, 1:], batch.num_drafts
    else:
        num_drafts = jnp.where(batch.active, k, 0).astype(jnp.int32)
        tokens = jnp.concatenate([tokens[:, :1], drafts], axis=1)
    model = nnx.merge(graphdef, params)
    md = batch.layer_meta(backend.metadata)  # rows of k + 1 tokens, flattened row-major as the model does
    logits, kv, *hidden = model(
        tokens, _rows(batch, batch.positions), kv, md, backend.forward, return_hidden=with_hidden
    )  # [S, T, V]
    if host_drafts:  # prompt lookup: plain decoding's own draws (accept_exact)
        s, t = tokens.shape
        gather = jnp.arange(s * t, dtype=jnp.int32).reshape(s, t)
        gather = gather[:, :1] + jnp.minimum(jnp.arange(t, dtype=jnp.int32)[None, :], num_drafts[:, None])
        flat = logits.reshape(s * t, -1)
        out, n_out = accept_exact(flat, gather, drafts, num_drafts, batch.sampling, do_sample, argmax_fn)
    else:
        out, n_out = accept(
            logits, drafts, draft_q, num_drafts, batch.sampling, do_sample=do_sample, argmax_fn=argmax_fn
        )
    if with_hidden:
        return kv, out, n_out, hidden[0].reshape(-1, hidden[0].shape[-1])
    return kv, out, n_out


def verify_ragged(
    graphdef,
    backend,
    params,
    kv,
    batch: StepBatch,
    logit_index,
    num_logits,
    gather,
    *,
    do_sample: bool,
    argmax_fn=argmax,
):
    """Verification inside the ragged step: the batch's rows are prompt chunks (sampling
    nothing), prompts' last chunks with their last token, and decode rows [last, d1..d_n]
    (n = num_drafts <= k host proposals: prompt lookup), all in one forward pass that reads
    every weight once. Only the real positions reach the vocabulary projection: logit_index
    [M] holds the flat index of each sampling row's last token and its n drafts, row after
    row, first (num_logits of them, traced; the rest pad), so a row that proposes nothing
    costs one position's logits whatever k was compiled. gather [R, k + 1]: each (row, j)'s
    place in logit_index (a row's last real place repeated past its drafts). Returns (kv,
    out_tokens [R, k+1], n_out [R]) as `verify`, by `accept_exact`."""
    model = nnx.merge(graphdef, params)
    md = batch.layer_meta(backend.metadata)
    live = batch.attn.query_start_loc[-1]
    logits, kv = model(
        batch.tokens[None],
        batch.positions[None],
        kv,
        md,
        backend.forward,
        token_index=logit_index,
        num_live_tokens=live,
        num_live_logits=num_logits,
    )
    drafts = batch.tokens[logit_index[gather[:, 1:]]]
    out, n_out = accept_exact(logits, gather, drafts, batch.num_drafts, batch.sampling, do_sample, argmax_fn)
    return kv, out, n_out


def accept_exact(logits, gather, drafts, num_drafts, sp, do_sample: bool, argmax_fn=argmax):
    """Verification of deterministic proposals (prompt lookup) that emits exactly what plain
    decoding would: the target's token y_j at every verified position j is drawn as the plain
    step draws it (`sampling.sample`: the argmax for greedy rows, the row's key at output
    position counter + j for sampled ones), drafts are accepted while d_j == y_j, and the
    first y_j that differs is the correction. For a one-hot proposal this is the rejection
    rule (accept d with probability p(d), then a draw from p restricted to the rest), coupled
    to plain decoding's draws: a seeded request's tokens do not depend on whether, or how far,
    a step speculated. logits [M, V] at the places `gather` [R, k + 1] indexes. Returns
    (out_tokens [R, k+1], n_out [R])."""
    r, t = gather.shape
    k = t - 1
    m = logits.shape[0]
    # each place's row and output offset: the smallest (row, j) gathering it (a row repeats its
    # last place past its drafts; padding rows and rows that sample nothing come later)
    flat = gather.reshape(-1)
    owner = jnp.full((m,), r, jnp.int32).at[flat].min(jnp.repeat(jnp.arange(r, dtype=jnp.int32), t))
    step = jnp.full((m,), t, jnp.int32).at[flat].min(jnp.tile(jnp.arange(t, dtype=jnp.int32), r))
    owner, step = jnp.minimum(owner, r - 1), jnp.where(step == t, 0, step)
    per_place = jax.tree.map(lambda x: x[owner], sp)
    per_place = dataclasses.replace(per_place, counters=per_place.counters + step)
    y, *_ = sample(logits, per_place, do_sample=do_sample, num_logprobs=0, argmax_fn=argmax_fn)
    y = y[gather]  # [R, k + 1]
    has_draft = jnp.arange(k)[None, :] < num_drafts[:, None]
    ok = (drafts == y[:, :k]) & has_draft
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    out = jnp.where(jnp.arange(t)[None, :] <= n_acc[:, None], y, 0)
    return out.astype(jnp.int32), (n_acc + 1).astype(jnp.int32)


def accept(logits, drafts, draft_q, num_drafts, sp, *, do_sample: bool, argmax_fn=argmax):
    """The acceptance rule over the target's logits [S, k+1, V] at [last, d1..dk]: drafts
    [S, k], draft_q [S, k, V] (a draft model's distributions) or None (deterministic proposals),
    num_drafts [S] real drafts per row. Returns (out_tokens [S, k+1], n_out [S])."""
    s, t = logits.shape[:2]
    k = t - 1
    temperature, top_k, top_p, seeds, counters = sp.temperature, sp.top_k, sp.top_p, sp.seeds, sp.counters
    idx = jnp.broadcast_to(jnp.arange(t), (s, t))
    has_draft = jnp.arange(k)[None, :] < num_drafts[:, None]
    target_argmax = argmax_fn(logits.reshape(s * t, -1)).reshape(s, t)
    greedy_ok = drafts == target_argmax[:, :k]
    if do_sample:
        rep = lambda x: jnp.repeat(x, t)  # noqa: E731  per-slot params for each position
        p = probs(logits.reshape(s * t, -1), rep(temperature), rep(top_k), rep(top_p)).reshape(s, t, -1)
        pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        if draft_q is None:  # deterministic proposal: q is one-hot at the draft
            q_full = jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype)
        else:
            q_full = draft_q
        qd = jnp.take_along_axis(q_full, drafts[..., None], axis=-1)[..., 0]
        keys = jax.vmap(lambda sd, c: jax.vmap(lambda j: slot_key(sd, c + j, TAG_ACCEPT))(jnp.arange(k)))(
            seeds, counters
        )
        u = jax.vmap(jax.vmap(jax.random.uniform))(keys)
        sample_ok = u * qd < pd  # u < p/q, safe when q = 0
        ok = jnp.where(temperature[:, None] > 0, sample_ok, greedy_ok) & has_draft
    else:
        ok = greedy_ok & has_draft
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepts
    # The token after the accepted drafts: the target's own choice at position n_acc.
    fix_greedy = jnp.take_along_axis(target_argmax, n_acc[:, None], axis=1)[:, 0]
    if do_sample:
        p_n = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
        q_pad = jnp.concatenate([q_full, jnp.zeros_like(q_full[:, :1])], axis=1)
        q_n = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
        resid = residual(p_n, q_n, n_acc < num_drafts)
        rkeys = jax.vmap(lambda sd, c: slot_key(sd, c, TAG_RESIDUAL))(seeds, counters + n_acc)
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, jnp.log(row)))(rkeys, resid).astype(jnp.int32)
        fix = jnp.where(temperature > 0, drawn, fix_greedy)
    else:
        fix = fix_greedy
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    out = jnp.where(idx < n_acc[:, None], padded, jnp.where(idx == n_acc[:, None], fix[:, None], 0))
    return out.astype(jnp.int32), (n_acc + 1).astype(jnp.int32)


class SpecStats:
    """Mean accepted tokens per target step and acceptance rate by draft position."""

    def __init__(self, k: int):
        self.k = k
        self.reset()

    def reset(self) -> None:
        k = self.k
        self.steps = 0  # slot-steps: one per slot per verification
        self.emitted = 0
        self.proposed = np.zeros(k, np.int64)
        self.accepted = np.zeros(k, np.int64)

    def record(self, num_drafts: int, n_out: int) -> None:
        self.steps += 1
        self.emitted += n_out
        self.proposed[:num_drafts] += 1
        self.accepted[: n_out - 1] += 1

    def as_dict(self) -> dict:
        return {
            "spec_mean_accepted": self.emitted / self.steps if self.steps else 0.0,
            "spec_acceptance_by_position": [float(a / p) if p else 0.0 for a, p in zip(self.accepted, self.proposed)],
            "spec_target_steps": self.steps,
        }
