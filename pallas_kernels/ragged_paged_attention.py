"""Ragged paged attention in Pallas: one kernel call for a flat array of query tokens where
every row (a request) has any number of them — 1 for decode, a chunk for prefill, k + 1 for
speculative verification — each row reading its keys through its own block table.

Semantics are exactly ``reference.ragged_paged_attention``'s: q [N, H, D]; row r owns tokens
[query_start_loc[r], query_start_loc[r + 1]); token n of row r sees key j iff
j < seq_lens[r] and j <= positions[n]; tokens that see nothing and padding tokens
(n >= query_start_loc[R]) get zeros. With ``sliding_window`` W (a layer's; None or 0: none),
token n also does not see key j <= positions[n] - W.

**Work items.** The wrapper (plain jnp, traced, so one compiled step serves every mix of rows)
cuts each row's tokens into query blocks of ``block_q`` tokens that never straddle two rows:
a decode row is one item, a 300-token chunk three items of 128. A batch of N tokens in R rows
has at most ``ceil(N / block_q) + R`` items, a static bound, so the grid is fixed; items past
the real ones are empty and cost only skipped grid steps. q is gathered into that item layout
([W, block_q, H, D], a copy of q's size) and the output gathered back. For each item the
wrapper also computes every token's visible-key limit ``min(seq_lens[r], positions[n] + 1)``
and the item's ``bound`` (the largest limit in it): the kernel reads pages only up to the
bound (causal early stop and no reads past the context) and masks per token by the limit.

* ``backend="tpu"`` (Mosaic style): grid (items, kv-head blocks, page blocks), the page axis
  sequential with the online softmax state in VMEM scratch. The per-item bound, the item's
  row and the flat block tables are scalar-prefetched into SMEM, and the K/V BlockSpecs' index
  maps pick each page from them: Pallas pipelines (double-buffers) the page DMAs, across items too,
  and past an item's last page the index is clamped (no DMA) and ``pl.when`` skips compute.
* ``backend="gpu"`` (Triton style): grid (items, kv heads); each program walks its item's
  pages with ``lax.fori_loop`` up to the bound, gathering ``pages_per_block`` pages per
  iteration through the row's block table straight from the pool.

Both handle the G = H // KVH query heads of one KV head in the same program (every K/V tile is
read once per group, K/V never repeated) and compute scores, softmax state and accumulators in
float32. Keys at or beyond an item's bound (the tail of the last page, pages past it) are
masked out of the scores and their V rows zeroed, so NaN there never reaches the result.
Quantized pages (int8 / float8 with bfloat16 scales [num_pages, page_size, KVH]) are widened
and multiplied by their per-token scale in the kernel, q in float32, as the oracle does.

**Sliding window.** A windowed call (static: a layer's W) adds each slot's first visible key
(``start``) beside its limit and the item's smallest (``first``): the kernel masks keys below a
token's start and skips the page blocks wholly before the item's first (TPU: their index maps
clamp to the first page needed, so no DMA, and ``pl.when`` skips compute; GPU: the page loop
starts there), so a windowed layer reads about W keys per token, not its whole context. An
unwindowed call builds exactly the kernel it did before windows existed.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import reference
from pallas_kernels.lowering import (
    GPU_TARGET_PROGRAMS,
    gpu_compiler_params,
    resolve,
    tpu_compiler_params,
    tpu_kv_heads_per_block,
)
from pallas_kernels.online_softmax import MASK_VALUE, combine_splits, dot_nt, normalise, online_softmax_step


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# -- work items: the plan shared by both lowerings ------------------------------------------


class WorkItems(NamedTuple):
    """Query blocks that each lie inside one row (all int32; W items, bq tokens each).

    row [W]: the item's row (empty items: some valid row, bound 0); bound [W]: keys the item
    needs (largest token limit in it); limit [W, bq]: each slot's visible-key limit (0 for
    slots past the item's tokens); token [W, bq]: the flat token of each slot (clamped);
    token_item / token_slot [N]: where each flat token sits; valid [N]: not padding.
    start [W, bq]: each slot's first visible key under the sliding window (0 without one);
    first [W]: the smallest start among the item's slots that see a key (0 for empty items)."""

    row: jax.Array
    bound: jax.Array
    limit: jax.Array
    token: jax.Array
    token_item: jax.Array
    token_slot: jax.Array
    valid: jax.Array
    start: jax.Array
    first: jax.Array


def plan_work_items(
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    positions: jax.Array,
    *,
    num_tokens: int,
    block_q: int,
    max_keys: int,
    sliding_window: int | None = None,
) -> WorkItems:
    """Cut each row's tokens into blocks of block_q (traced: any row mix, one static shape).
    max_keys (pages per row x page size) caps every limit: keys past a block table don't exist.
    sliding_window: each slot's first visible key (`reference.window_start`)."""
    qsl = query_start_loc.astype(jnp.int32)
    r = qsl.shape[0] - 1
    w = min(_cdiv(num_tokens, block_q) + r, num_tokens)  # sum(ceil(len_r / bq)) <= N / bq + R
    qlen = jnp.maximum(qsl[1:] - qsl[:-1], 0)
    per_row = (qlen + block_q - 1) // block_q
    cum = jnp.cumsum(per_row)  # inclusive: items of rows 0..r
    first = cum - per_row
    wi = jnp.arange(w, dtype=jnp.int32)
    # Item w belongs to the first row whose cumulative count exceeds w (rows without tokens
    # have no items and are passed over).
    row = jnp.minimum(jnp.searchsorted(cum, wi, side="right"), r - 1).astype(jnp.int32)
    start = qsl[row] + (wi - first[row]) * block_q
    length = jnp.where(wi < cum[-1], jnp.clip(qsl[row + 1] - start, 0, block_q), 0)

    n = jnp.arange(num_tokens, dtype=jnp.int32)
    trow = reference.token_rows(qsl, num_tokens).astype(jnp.int32)
    valid = reference.ragged_valid(qsl, num_tokens)
    sees = jnp.minimum(seq_lens.astype(jnp.int32)[trow], positions.astype(jnp.int32) + 1)
    tok_limit = jnp.where(valid, jnp.clip(sees, 0, max_keys), 0)
    off = jnp.maximum(n - qsl[trow], 0)
    token_item = jnp.clip(first[trow] + off // block_q, 0, w - 1)
    token_slot = off % block_q

    slot = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    token = jnp.clip(start[:, None] + slot, 0, num_tokens - 1)
    limit = jnp.where(slot < length[:, None], tok_limit[token], 0)
    start = reference.window_start(positions.astype(jnp.int32), sliding_window)[token]
    sees = limit > start
    first = jnp.min(jnp.where(sees, start, jnp.iinfo(jnp.int32).max), axis=1)
    first = jnp.where(jnp.any(sees, axis=1), first, 0)
    return WorkItems(row, jnp.max(limit, axis=1), limit, token, token_item, token_slot, valid, start, first)


# -- TPU (Mosaic) lowering ------------------------------------------------------------------


def _item_layout(x, items, kv_heads):
    """[N, H, ...] -> [W, KVH, G*bq, ...]: each item's tokens, the G query heads of one KV head
    stacked along the rows (row g*bq + t), so one matmul serves the whole head group."""
    n, h = x.shape[:2]
    g = h // kv_heads
    w, bq = items.token.shape
    x = x.reshape(n, kv_heads, g, *x.shape[2:])[items.token]  # [W, bq, KVH, G, ...]
    x = jnp.moveaxis(x, 1, 3)  # [W, KVH, G, bq, ...]
    return x.reshape(w, kv_heads, g * bq, *x.shape[4:])


def _token_layout(out, items, kv_heads, groups):
    """The inverse of _item_layout: [W, KVH, G*bq, D] -> [N, H, D] (padding tokens: zeros)."""
    w, _, _, d = out.shape
    out = out.reshape(w, kv_heads, groups, -1, d)
    got = out[items.token_item, :, :, items.token_slot]  # [N, KVH, G, D]
    got = got.reshape(got.shape[0], kv_heads * groups, d)
    return jnp.where(items.valid[:, None, None], got, jnp.zeros_like(got))


def _tpu_kernel(
    *refs,
    pages_per_block: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    quantized: bool,
    windowed: bool,
):
    """One (item, kv-head block, page block) step.

    SMEM: bound_ref [W], row_ref [W], bt_ref [R*P] (windowed: first_ref [W]). q_ref/o_ref
    [kv_heads, G*bq, D]; lim_ref [G*bq, 1] (windowed: then start_ref [G*bq, 1]);
    pages_per_block K page refs then as many V page refs, each
    [ps, kv_heads*D] (heads as lane blocks of the free reshape of the pool); quantized: as
    many K and V scale refs, each [ps, KVH] (all heads: a one-head lane block of a narrow
    array is not a legal Mosaic block); scratch m/l [kv_heads, G*bq, 1], acc [kv_heads, G*bq, D].
    """
    bound_ref, row_ref, bt_ref = refs[:3]
    first_ref, refs = (refs[3], refs[4:]) if windowed else (None, refs[3:])
    q_ref, lim_ref = refs[:2]
    start_ref, refs = (refs[2], refs[3:]) if windowed else (None, refs[2:])
    n = pages_per_block
    k_refs, v_refs = refs[:n], refs[n : 2 * n]
    nq = 2 * n if quantized else 0
    ks_refs, vs_refs = refs[2 * n : 3 * n], refs[3 * n : 2 * n + nq]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * n + nq :]
    w, hj, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bound = bound_ref[w]
    d, ps = head_dim, page_size

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    live = i * n * ps < bound  # page blocks past the item's last visible key: no compute
    if windowed:  # nor before its first
        live = live & ((i + 1) * n * ps > first_ref[w])

    @pl.when(live)
    def _compute():
        limit = lim_ref[...]  # [G*bq, 1]
        for j in range(kv_heads):  # static
            m, l, acc = m_ref[j], l_ref[j], acc_ref[j]
            q = q_ref[j]  # [G*bq, D]
            if quantized:
                q = q.astype(jnp.float32)
            for c in range(n):  # static: the pages of this block, in sequence order
                start = (i * n + c) * ps
                kpos_row = start + lax.broadcasted_iota(jnp.int32, (1, ps), 1)
                kpos_col = start + lax.broadcasted_iota(jnp.int32, (ps, 1), 0)
                k = k_refs[c][:, pl.ds(j * d, d)]
                v = v_refs[c][:, pl.ds(j * d, d)]
                if quantized:  # this head's per-token scale as a [ps, 1] column
                    head = hj * kv_heads + j
                    k = k.astype(jnp.float32) * _head_column(ks_refs[c][...], head)
                    v = v.astype(jnp.float32) * _head_column(vs_refs[c][...], head)
                keep = kpos_col < bound
                if windowed:  # a block clamped to the first page holds another position's V
                    keep = keep & (kpos_col >= first_ref[w])
                v = jnp.where(keep, v, jnp.zeros_like(v))
                s = dot_nt(q, k) * scale
                mask = kpos_row < limit  # causal and context, per token
                if windowed:
                    mask = mask & (kpos_row >= start_ref[...])
                mask = jnp.broadcast_to(mask, s.shape)
                m, l, acc = online_softmax_step(m, l, acc, s, mask, v)
            m_ref[j], l_ref[j], acc_ref[j] = m, l, acc

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        for j in range(kv_heads):
            o_ref[j] = normalise(acc_ref[j], l_ref[j]).astype(o_ref.dtype)


def _head_column(scales, head):
    """scales [ps, KVH] (bfloat16) -> float32 [ps, 1] of one (possibly traced) head: a masked
    lane sum, legal for any head index where a dynamic lane slice is not. jnp.where, not a
    multiply, so NaN scales of other heads stay out."""
    s = scales.astype(jnp.float32)
    lane = lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.sum(jnp.where(lane == head, s, 0.0), axis=1, keepdims=True)


def _ragged_tpu(
    q, k_pages, v_pages, k_scales, v_scales, items, block_tables, *, scale, pages_per_block, hb, interpret, windowed
):
    _, h, d = q.shape
    num_pages, ps, kvh, _ = k_pages.shape
    p = block_tables.shape[1]
    w, bq = items.token.shape
    g = h // kvh
    if kvh % hb:
        raise ValueError(f"kv_heads_per_block {hb} must divide kv heads {kvh}")
    n = max(1, min(pages_per_block or max(1, 128 // ps), p))
    nblk = _cdiv(p, n)
    quantized = k_scales is not None

    def page_spec(c):
        def index_map(wi, hj, i, bound_ref, row_ref, bt_ref, *first_ref):
            # lax.div: jnp's floor division of signed ints needs sign(), which Mosaic lowers
            # only with a TPU attached; bounds are never negative.
            last = jnp.clip(lax.div(bound_ref[wi] + ps - 1, ps) - 1, 0, p - 1)
            page = jnp.minimum(i * n + c, last)
            if first_ref:  # a window: pages before the item's first key repeat it (no DMA)
                page = jnp.maximum(page, jnp.minimum(lax.div(first_ref[0][wi], ps), last))
            return bt_ref[row_ref[wi] * p + page], 0, hj

        return pl.BlockSpec((None, ps, hb * d), index_map)

    def scale_spec(c):  # every head's scales of the same page: [ps, KVH]
        page = page_spec(c).index_map
        return pl.BlockSpec((None, ps, kvh), lambda wi, hj, i, *pf: (page(wi, hj, i, *pf)[0], 0, 0))

    q_spec = pl.BlockSpec((None, hb, g * bq, d), lambda wi, hj, i, *pf: (wi, hj, 0, 0))
    lim_spec = pl.BlockSpec((None, g * bq, 1), lambda wi, hj, i, *pf: (wi, 0, 0))
    kernel = functools.partial(
        _tpu_kernel,
        pages_per_block=n,
        page_size=ps,
        kv_heads=hb,
        head_dim=d,
        scale=scale,
        quantized=quantized,
        windowed=windowed,
    )
    scales = [k_scales] * n + [v_scales] * n if quantized else []
    tile = lambda x: jnp.tile(x, (1, g))[:, :, None]  # noqa: E731  (row g*bq + t: token t's)
    prefetch = (items.bound, items.row, block_tables.astype(jnp.int32).reshape(-1))
    per_token = (tile(items.limit),)
    if windowed:
        prefetch, per_token = (*prefetch, items.first), (*per_token, tile(items.start))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(w, kvh // hb, nblk),
            in_specs=[q_spec]
            + [lim_spec] * len(per_token)
            + [page_spec(c) for c in range(n)] * 2
            + [scale_spec(c) for c in range(n)] * (2 * quantized),
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((hb, g * bq, 1), jnp.float32),
                pltpu.VMEM((hb, g * bq, 1), jnp.float32),
                pltpu.VMEM((hb, g * bq, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((w, kvh, g * bq, d), q.dtype),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        *prefetch,
        _item_layout(q, items, kvh),
        *per_token,
        *([k_pages.reshape(num_pages, ps, kvh * d)] * n),  # free: heads become lane blocks
        *([v_pages.reshape(num_pages, ps, kvh * d)] * n),
        *scales,
    )
    return _token_layout(out, items, kvh, g)


# -- GPU (Triton) lowering ------------------------------------------------------------------


def _gpu_kernel(
    q_ref,
    lim_ref,
    info_ref,
    bt_ref,
    k_ref,
    v_ref,
    *rest,
    page_size: int,
    pages_per_block: int,
    scale: float,
    quantized: bool,
    split: bool,
    windowed: bool,
):
    """One (item, kv head, split) program.

    q_ref [G*bq, D] (the head group's rows of the item); lim_ref [G*bq]; info_ref [8] =
    (page blocks to read, bound, the first page block any slot sees (0 without a window), page
    blocks per split for this item, then [full_from, full_to): the blocks every live slot sees
    whole, run without masks, 0, 0); windowed: then start_ref [G*bq] (each row's first visible
    key) before the pages; bt_ref [Pp]: the item's row of the block table; k_ref/v_ref
    [num_pages, ps, D]: this KV head's view of the whole pool (a pointer); quantized:
    ks_ref/vs_ref [num_pages, ps]. Split s walks the item's page blocks [first + s * per_split,
    first + (s + 1) * per_split): a long item uses every split, a short one the first few (the
    rest see nothing); split: it writes its unnormalised acc [G*bq, D] and m, l [G*bq] for
    combine_splits, else (one split) the normalised output o_ref [G*bq, D].
    """
    start_ref, rest = (rest[0], rest[1:]) if windowed else (None, rest)
    if quantized:
        ks_ref, vs_ref, *outs = rest
    else:
        outs = rest
    ps, n = page_size, pages_per_block
    span = n * ps
    rows, d = q_ref.shape
    steps, bound = info_ref[0], info_ref[1]
    limit = lim_ref[...]
    q = q_ref[...]
    if quantized:
        q = q.astype(jnp.float32)

    def body(it, carry, masked=True):
        pages = bt_ref[pl.ds(it * n, n)]
        k = k_ref[pages].reshape(span, d)
        v = v_ref[pages].reshape(span, d)
        if quantized:  # dequantize per token: int8/fp8 times its bfloat16 scale, in float32
            k = k.astype(jnp.float32) * ks_ref[pages].reshape(span, 1).astype(jnp.float32)
            v = v.astype(jnp.float32) * vs_ref[pages].reshape(span, 1).astype(jnp.float32)
        s = dot_nt(q, k) * scale
        if not masked:  # every key below every live slot's limit: no NaN slot, nothing hidden
            return online_softmax_step(*carry, s, None, v)
        kpos = it * span + lax.broadcasted_iota(jnp.int32, (span,), 0)
        v = jnp.where((kpos < bound)[:, None], v, jnp.zeros_like(v))
        mask = kpos[None, :] < limit[:, None]
        if windowed:
            mask = mask & (kpos[None, :] >= start_ref[...][:, None])
        return online_softmax_step(*carry, s, mask, v)

    init = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )
    per_split = info_ref[3]
    first = info_ref[2] + pl.program_id(2) * per_split  # from the item's first block (a window's)
    last = jnp.maximum(first, jnp.minimum(first + per_split, steps))  # to its last visible key
    # the diagonal's and the window edge's blocks masked, the whole ones between not
    a = jnp.clip(info_ref[4], first, last)
    b = jnp.clip(info_ref[5], a, last)
    carry = lax.fori_loop(first, a, body, init)
    carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
    m, l, acc = lax.fori_loop(b, last, body, carry)
    if split:
        acc_ref, m_ref, l_ref = outs
        acc_ref[...] = acc
        m_ref[...] = m[:, 0]
        l_ref[...] = l[:, 0]
    else:
        (o_ref,) = outs
        o_ref[...] = normalise(acc, l).astype(o_ref.dtype)


def _ragged_gpu(
    q,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    items,
    block_tables,
    *,
    scale,
    pages_per_block,
    interpret,
    num_warps,
    num_stages,
    num_splits,
    windowed,
):
    _, h, d = q.shape
    num_pages, ps, kvh, _ = k_pages.shape
    p = block_tables.shape[1]
    w, bq = items.token.shape
    g = h // kvh
    quantized = k_scales is not None
    n = min(_next_pow2(pages_per_block or max(1, 64 // ps)), _next_pow2(p))
    pp = _next_pow2(p)  # Triton blocks are powers of two; padding entries (page 0) are never read
    span = n * ps
    blocks = _cdiv(p, n)
    splits = gpu_splits(w, kvh, g * bq * d, blocks, num_splits)
    if num_splits is None:  # long items of a step with many items (a mixed step's decode rows)
        splits = max(splits, gpu_long_item_splits(w, kvh, g * bq * d, blocks))
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pp - p)))[items.row]  # [W, Pp]
    steps = (items.bound + span - 1) // span
    first = items.first // span if windowed else jnp.zeros_like(steps)
    # each item's own blocks spread evenly over the splits (not the table's width): a row far
    # shorter than max_model_len still uses every split
    per_split = jnp.maximum(_cdiv_traced(steps - first, splits), 1)
    full_from, full_to = _whole_blocks(items, span)
    zero = jnp.zeros_like(steps)
    info = [steps, items.bound, first, per_split, full_from, full_to, zero, zero]  # 8: a power of two
    info = jnp.stack(info, axis=-1).astype(jnp.int32)  # [W, 8]
    kernel = functools.partial(
        _gpu_kernel,
        page_size=ps,
        pages_per_block=n,
        scale=scale,
        quantized=quantized,
        split=splits > 1,
        windowed=windowed,
    )
    q_spec = pl.BlockSpec((None, None, g * bq, d), lambda wi, hi, si: (wi, hi, 0, 0))
    page_spec = pl.BlockSpec((num_pages, ps, None, d), lambda wi, hi, si: (0, 0, hi, 0))
    scale_spec = pl.BlockSpec((num_pages, ps, None), lambda wi, hi, si: (0, 0, hi))
    if splits > 1:  # unnormalised partials per split, merged below (flash-decoding)
        out_specs = [
            pl.BlockSpec((None, None, None, g * bq, d), lambda wi, hi, si: (si, wi, hi, 0, 0)),
            pl.BlockSpec((None, None, None, g * bq), lambda wi, hi, si: (si, wi, hi, 0)),
            pl.BlockSpec((None, None, None, g * bq), lambda wi, hi, si: (si, wi, hi, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((splits, w, kvh, g * bq, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, w, kvh, g * bq), jnp.float32),
            jax.ShapeDtypeStruct((splits, w, kvh, g * bq), jnp.float32),
        ]
    else:
        out_specs, out_shape = q_spec, jax.ShapeDtypeStruct((w, kvh, g * bq, d), q.dtype)
    out = pl.pallas_call(
        kernel,
        grid=(w, kvh, splits),
        in_specs=[
            q_spec,
            pl.BlockSpec((None, g * bq), lambda wi, hi, si: (wi, 0)),
            pl.BlockSpec((None, info.shape[1]), lambda wi, hi, si: (wi, 0)),
            pl.BlockSpec((None, pp), lambda wi, hi, si: (wi, 0)),
            page_spec,
            page_spec,
            *([pl.BlockSpec((None, g * bq), lambda wi, hi, si: (wi, 0))] if windowed else []),
            *([scale_spec, scale_spec] if quantized else []),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=gpu_compiler_params(num_warps or (4 if d <= 64 else 8), num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        _item_layout(q, items, kvh),
        jnp.tile(items.limit, (1, g)),
        info,
        bt,
        k_pages,
        v_pages,
        *((jnp.tile(items.start, (1, g)),) if windowed else ()),
        *((k_scales, v_scales) if quantized else ()),
    )
    if splits > 1:
        out = combine_splits(*out).astype(q.dtype)
    return _token_layout(out, items, kvh, g)


# Split-K fills the GPU when few programs walk long contexts (a small decode batch): enough
# splits for GPU_TARGET_PROGRAMS programs, while the float32
# partials stay small (they are written and read back once).
_MAX_PARTIAL_BYTES = 16 << 20


def gpu_splits(items: int, kv_heads: int, item_elems: int, blocks: int, num_splits: int | None) -> int:
    """Splits of each item's page blocks for the GPU lowering: num_splits if given, else enough
    for GPU_TARGET_PROGRAMS programs, at most one per page block and at most _MAX_PARTIAL_BYTES of
    partial results. A step with many items (a mixed step, a large decode batch) gets 1."""
    if num_splits is None:
        num_splits = _cdiv(GPU_TARGET_PROGRAMS, items * kv_heads)
        num_splits = min(num_splits, max(1, _MAX_PARTIAL_BYTES // (items * kv_heads * (item_elems + 2) * 4)))
    return max(1, min(num_splits, blocks))


def _whole_blocks(items: WorkItems, span: int) -> tuple[jax.Array, jax.Array]:
    """[W] page blocks [full_from, full_to) that every slot of the item that sees a key sees
    whole: past the largest window start, before the smallest limit (the diagonal's block and
    the context's last are partial). Slots that see nothing are not counted (their rows are
    never gathered back); an item without such a slot gets an empty range."""
    live = items.limit > items.start
    big = jnp.iinfo(jnp.int32).max
    full_to = jnp.min(jnp.where(live, items.limit, big), axis=1) // span
    full_from = (jnp.max(jnp.where(live, items.start, 0), axis=1) + span - 1) // span
    any_live = jnp.any(live, axis=1)
    return jnp.where(any_live, full_from, 0), jnp.where(any_live, full_to, 0)


# A mixed step has too many items for gpu_splits (34 items x 8 KV heads already fill an H200),
# yet its decode rows each walk their whole context in one program while the chunk's items are
# short: the step lasts as long as its longest item (docs/kernels.md, "H200 results": 5.8x a
# split-K decode kernel). So such a step is split too: a split of a full-width item walks at
# least MIN_BLOCKS_PER_SPLIT page blocks, at most MAX_LONG_ITEM_SPLITS splits, and the partials
# of every item (the grid is uniform) stay within _MAX_LONG_ITEM_PARTIAL_BYTES; each item
# spreads its own blocks over the splits (a short one walks a block or none in each).
MIN_BLOCKS_PER_SPLIT = 4
MAX_LONG_ITEM_SPLITS = 8
_MAX_LONG_ITEM_PARTIAL_BYTES = 64 << 20


def gpu_long_item_splits(items: int, kv_heads: int, item_elems: int, blocks: int) -> int:
    """Splits for a step's longest items whatever the item count: enough that an item of
    `blocks` page blocks (the block table's width) splits into pieces of MIN_BLOCKS_PER_SPLIT,
    capped by MAX_LONG_ITEM_SPLITS and the partials' bytes."""
    by_bytes = _MAX_LONG_ITEM_PARTIAL_BYTES // (items * kv_heads * (item_elems + 2) * 4)
    return max(1, min(MAX_LONG_ITEM_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT, by_bytes))


def _cdiv_traced(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


# -- public entry points --------------------------------------------------------------------


def _check_inputs(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, positions, k_scales, v_scales):
    """Shape errors naming the field, before anything is traced into a kernel."""
    if q.ndim != 3:
        raise ValueError(f"q must be [N, H, D], got shape {q.shape}")
    n, h, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape[-1] != d:
        raise ValueError(f"k_pages must be [num_pages, page_size, KVH, {d}], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages {v_pages.shape} must have k_pages' shape {k_pages.shape}")
    kvh = k_pages.shape[2]
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
        raise ValueError(f"query_start_loc must be [R + 1] with R >= 1, got shape {query_start_loc.shape}")
    r = query_start_loc.shape[0] - 1
    if seq_lens.shape != (r,):
        raise ValueError(f"seq_lens must be [{r}] (one per row of query_start_loc), got shape {seq_lens.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != r:
        raise ValueError(f"block_tables must be [{r}, P], got shape {block_tables.shape}")
    if positions.shape != (n,):
        raise ValueError(f"positions must be [{n}] (one per token of q), got shape {positions.shape}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together")
    if k_scales is not None and (k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_pages.shape[:3]):
        raise ValueError(f"k_scales/v_scales must be {k_pages.shape[:3]}, got {k_scales.shape} and {v_scales.shape}")


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    backend: str | None = None,
    interpret: bool | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    kv_heads_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    num_splits: int | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Attention of the flat ragged batch q [N, H, D] over each row's pages -> [N, H, D] in
    q.dtype, with ``reference.ragged_paged_attention``'s semantics.

    query_start_loc [R+1] int32 (nondecreasing, from 0, last <= N); seq_lens [R];
    block_tables [R, P] (entries past a row's context must still be valid page indices);
    positions [N]. k_pages/v_pages [num_pages, page_size, KVH, D] in the model dtype, or
    int8 / float8 with k_scales/v_scales bfloat16 [num_pages, page_size, KVH].
    scale defaults to 1/sqrt(D). backend "tpu" / "gpu" (default by jax.default_backend());
    interpret defaults to False only where the platform runs that lowering natively.
    Knobs: block_q (tokens per work item: every row is cut into items of block_q tokens and
    each item computes all block_q x G rows, so small values waste less on decode rows and
    large ones re-read K/V less for long chunks; TPU default 32, any size; GPU default 16, a
    power of two with G * block_q >= 16), pages_per_block (TPU: pages per grid step, default 128 tokens'
    worth; GPU: pages per loop iteration, default 64 tokens' worth), kv_heads_per_block (TPU;
    default lowering.tpu_kv_heads_per_block), num_warps / num_stages (GPU), num_splits (GPU: split-K, each
    item's pages cut across that many programs and merged after; default: gpu_splits' (enough
    programs for a small decode batch) or gpu_long_item_splits' (a mixed step's long items),
    whichever is larger; each item spreads its own page blocks over them). None are tuned on
    hardware.
    sliding_window W (None or 0: full attention): token n sees only keys j > positions[n] - W.
    """
    backend, interpret = resolve(backend, interpret)
    _check_inputs(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, positions, k_scales, v_scales)
    n_tok, h, d = q.shape
    if n_tok == 0:
        return jnp.zeros_like(q)
    _, ps, kvh, _ = k_pages.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = h // kvh
    if backend == "tpu":  # the q block spans all G*bq rows of an item, so any bq is a legal block
        bq = block_q or min(32, -(-n_tok // 8) * 8)
    else:  # Triton: G*bq rows, a power of two of at least 16 (tl.dot's minimum)
        bq = max(_cdiv(16, g), min(_next_pow2(block_q or 16), _next_pow2(n_tok)))
    items = plan_work_items(
        query_start_loc,
        seq_lens,
        positions,
        num_tokens=n_tok,
        block_q=bq,
        max_keys=block_tables.shape[1] * ps,
        sliding_window=sliding_window,
    )
    windowed = bool(sliding_window)
    if backend == "tpu":
        hb = kv_heads_per_block or tpu_kv_heads_per_block(d, kvh, interpret)
        out = _ragged_tpu(
            q,
            k_pages,
            v_pages,
            k_scales,
            v_scales,
            items,
            block_tables,
            scale=scale,
            pages_per_block=pages_per_block,
            hb=hb,
            interpret=interpret,
            windowed=windowed,
        )
    else:
        out = _ragged_gpu(
            q,
            k_pages,
            v_pages,
            k_scales,
            v_scales,
            items,
            block_tables,
            scale=scale,
            pages_per_block=pages_per_block,
            interpret=interpret,
            num_warps=num_warps,
            num_stages=num_stages,
            num_splits=num_splits,
            windowed=windowed,
        )
    return out
