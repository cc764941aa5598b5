"""Paged decode attention in Pallas: one query token per row over its pages (flash-decoding).
The serving path runs ``ragged_paged_attention`` (rows of any length, decode included); this
kernel stays as the decode-only specialisation and the base that one grew from.

The page pool is [num_pages, page_size, KVH, D]; a slot's context is the pages of its row of
``block_tables`` in order, of which the first ``context_lens[b]`` tokens are live. Decode
reads K/V straight from the pool through the block table (no gather into a contiguous
copy).

* ``backend="tpu"`` (Mosaic style): block tables and lengths are scalar-prefetched into
  SMEM (``PrefetchScalarGridSpec(num_scalar_prefetch=2)``) so the K/V BlockSpecs' index
  maps can pick pages from them; the grid is (batch, kv heads, page blocks) with the page
  axis sequential and the softmax state in VMEM scratch. A page block is
  ``pages_per_block`` pages: the pool is passed once per page of the block, each operand's
  index map picking its own page, so Pallas pipelines several page DMAs per step. Past a
  slot's last page the index is clamped to it: no new DMA and no compute.
* ``backend="gpu"`` (Triton style): split-K (flash-decoding). The grid is (batch, kv heads,
  splits); each program walks its share of the slot's pages, gathering ``pages_per_iter``
  pages per iteration through the block table, for the G query heads of one KV head at once
  (padded to 16 rows, tl.dot's minimum). Programs write an unnormalised accumulator with
  its running max and sum; a log-sum-exp combine in jnp merges the splits. Splits keep the
  GPU busy when batch x kv heads is small and contexts are long.

Keys at or beyond ``context_lens[b]`` (the tail of the last page, pages past the end) never
reach the result, even if they hold NaN. A slot with context length 0 gets zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention import (
    MASK_VALUE,
    dot_nt,
    gpu_compiler_params,
    normalise,
    online_softmax_step,
    resolve,
    tpu_compiler_params,
    tpu_kv_heads_per_block,
)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# -- TPU (Mosaic) lowering ------------------------------------------------------------------


def _tpu_decode_kernel(
    lens_ref,
    bt_ref,
    q_ref,
    *refs,
    pages_per_block: int,
    page_size: int,
    groups: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    quantized: bool = False,
):
    """One (batch, kv-head block, page block) step.

    lens_ref [B], bt_ref [B*P] in SMEM; q_ref/o_ref [kv_heads*G, D]; then pages_per_block
    K page refs and as many V page refs, each [page_size, kv_heads*D] (quantized: then as
    many K and V scale refs, each [page_size, kv_heads]); scratch m/l [kv_heads*G, 1] and
    acc [kv_heads*G, D].
    """
    n = pages_per_block
    k_refs, v_refs = refs[:n], refs[n : 2 * n]
    nq = 2 * n if quantized else 0
    ks_refs, vs_refs = refs[2 * n : 3 * n], refs[3 * n : 2 * n + nq]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * n + nq :]
    b, i = pl.program_id(0), pl.program_id(2)
    length = lens_ref[b]
    d, ps = head_dim, page_size

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i * n * ps < length)  # page blocks past the context: no compute
    def _compute():
        for j in range(kv_heads):  # static
            rows = pl.ds(j * groups, groups)
            m, l, acc = m_ref[rows, :], l_ref[rows, :], acc_ref[rows, :]
            q = q_ref[rows, :]
            if quantized:
                q = q.astype(jnp.float32)
            for c in range(n):  # static: the pages of this block, in sequence order
                start = (i * n + c) * ps
                kpos_row = start + lax.broadcasted_iota(jnp.int32, (1, ps), 1)
                kpos_col = start + lax.broadcasted_iota(jnp.int32, (ps, 1), 0)
                k = k_refs[c][:, pl.ds(j * d, d)]
                v = v_refs[c][:, pl.ds(j * d, d)]
                if quantized:  # one bfloat16 scale per token of this head: [ps, 1] across the lanes
                    k = k.astype(jnp.float32) * ks_refs[c][:, pl.ds(j, 1)].astype(jnp.float32)
                    v = v.astype(jnp.float32) * vs_refs[c][:, pl.ds(j, 1)].astype(jnp.float32)
                v = jnp.where(kpos_col < length, v, jnp.zeros_like(v))
                s = dot_nt(q, k) * scale
                mask = jnp.broadcast_to(kpos_row < length, s.shape)
                m, l, acc = online_softmax_step(m, l, acc, s, mask, v)
            m_ref[rows, :], l_ref[rows, :], acc_ref[rows, :] = m, l, acc

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = normalise(acc_ref[...], l_ref[...]).astype(o_ref.dtype)


def _paged_decode_tpu(
    q,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    *,
    scale,
    pages_per_block,
    interpret,
    kv_heads_per_block,
    k_scales=None,
    v_scales=None,
):
    b, h, d = q.shape
    num_pages, ps, kvh, _ = k_pages.shape
    p = block_tables.shape[1]
    g = h // kvh
    hb = kv_heads_per_block or tpu_kv_heads_per_block(d, kvh, interpret)
    if kvh % hb:
        raise ValueError(f"kv_heads_per_block {hb} must divide kv heads {kvh}")
    n = max(1, min(pages_per_block or max(1, 128 // ps), p))
    nblk = -(-p // n)

    def page_spec(c):
        def index_map(bi, hj, i, lens_ref, bt_ref):
            # lax.div: jnp's floor division of signed ints needs sign(), which Mosaic lowers
            # only with a TPU attached; lengths are never negative.
            last = jnp.clip(lax.div(lens_ref[bi] + ps - 1, ps) - 1, 0, p - 1)
            return bt_ref[bi * p + jnp.minimum(i * n + c, last)], 0, hj

        return pl.BlockSpec((None, ps, hb * d), index_map)

    quantized = k_scales is not None

    def scale_spec(c):  # the scales of the same page and heads: [ps, hb]
        page = page_spec(c).index_map
        return pl.BlockSpec((None, ps, hb), page)

    q_spec = pl.BlockSpec((None, None, hb * g, d), lambda bi, hj, i, lr, br: (bi, hj, 0, 0))
    kernel = functools.partial(
        _tpu_decode_kernel,
        pages_per_block=n,
        page_size=ps,
        groups=g,
        kv_heads=hb,
        head_dim=d,
        scale=scale,
        quantized=quantized,
    )
    scales = [k_scales] * n + [v_scales] * n if quantized else []
    kf = k_pages.reshape(num_pages, ps, kvh * d)  # free: heads become lane blocks
    vf = v_pages.reshape(num_pages, ps, kvh * d)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh // hb, nblk),
            in_specs=[q_spec]
            + [page_spec(c) for c in range(n)] * 2
            + [scale_spec(c) for c in range(n)] * (2 * quantized),
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((hb * g, 1), jnp.float32),
                pltpu.VMEM((hb * g, 1), jnp.float32),
                pltpu.VMEM((hb * g, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, kvh // hb, hb * g, d), q.dtype),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_decode_tpu",
    )(
        context_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        q.reshape(b, kvh // hb, hb * g, d),
        *([kf] * n),
        *([vf] * n),
        *scales,
    )
    return out.reshape(b, h, d)


# -- GPU (Triton) lowering ------------------------------------------------------------------


# Split-K's target on a GPU: about two programs per SM of an H100/H200 (132 SMs). The ragged
# kernel's GPU lowering sizes its splits by the same number.
GPU_TARGET_PROGRAMS = 264


def _gpu_decode_kernel(
    *refs,
    page_size: int,
    pages_per_iter: int,
    pages_per_split: int,
    scale: float,
    quantized: bool = False,
):
    """One (batch, kv head, split) program.

    refs: q_ref [Gp, D] (the head group, zero-padded to Gp rows); k_ref/v_ref [num_pages,
    ps, D]: this KV head's view of the whole pool; quantized: ks_ref/vs_ref [num_pages, ps],
    its scales; bt_ref [pages_per_split]: this split's slice of the slot's block table;
    len_ref [1]. Writes the unnormalised acc [Gp, D] with m, l [Gp].
    """
    if quantized:
        q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref, len_ref, acc_ref, m_ref, l_ref = refs
    else:
        q_ref, k_ref, v_ref, bt_ref, len_ref, acc_ref, m_ref, l_ref = refs
    ps, n = page_size, pages_per_iter
    span = n * ps
    q = q_ref[...]
    if quantized:
        q = q.astype(jnp.float32)
    gp, d = q.shape
    length = len_ref[0]
    first = pl.program_id(2) * pages_per_split
    live_pages = jnp.clip(lax.div(length + ps - 1, ps) - first, 0, pages_per_split)

    def body(it, carry):
        m, l, acc = carry
        pages = bt_ref[pl.ds(it * n, n)]
        k = k_ref[pages].reshape(span, d)
        v = v_ref[pages].reshape(span, d)
        if quantized:  # dequantize per token: int8/fp8 times its bfloat16 scale, in float32
            k = k.astype(jnp.float32) * ks_ref[pages].reshape(span, 1).astype(jnp.float32)
            v = v.astype(jnp.float32) * vs_ref[pages].reshape(span, 1).astype(jnp.float32)
        kpos = (first + it * n) * ps + lax.broadcasted_iota(jnp.int32, (span,), 0)
        valid = kpos < length
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        s = dot_nt(q, k) * scale
        mask = jnp.broadcast_to(valid[None, :], s.shape)
        return online_softmax_step(m, l, acc, s, mask, v)

    init = (
        jnp.full((gp, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((gp, 1), jnp.float32),
        jnp.zeros((gp, d), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, lax.div(live_pages + n - 1, n), body, init)
    acc_ref[...] = acc
    m_ref[...] = m[:, 0]
    l_ref[...] = l[:, 0]


def _paged_decode_gpu(
    q,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    *,
    scale,
    pages_per_iter,
    num_splits,
    interpret,
    num_warps,
    num_stages,
    k_scales=None,
    v_scales=None,
):
    b, h, d = q.shape
    num_pages, ps, kvh, _ = k_pages.shape
    p = block_tables.shape[1]
    g = h // kvh
    gp = max(16, _next_pow2(g))
    quantized = k_scales is not None
    n = pages_per_iter or max(1, 64 // ps)
    n = min(n, _next_pow2(p))
    iters = -(-p // n)
    # Enough programs to fill an H100/H200 twice when batch x kv heads is small.
    splits = max(1, min(num_splits or -(-GPU_TARGET_PROGRAMS // (b * kvh)), iters))
    per_split = -(-iters // splits) * n
    splits = -(-p // per_split)
    # Padding entries point at page 0; they lie past every context and are masked.
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, splits * per_split - p))).reshape(b, splits, per_split)
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    kernel = functools.partial(
        _gpu_decode_kernel,
        page_size=ps,
        pages_per_iter=n,
        pages_per_split=per_split,
        scale=scale,
        quantized=quantized,
    )
    page_spec = pl.BlockSpec((num_pages, ps, None, d), lambda bi, hi, si: (0, 0, hi, 0))
    scale_spec = pl.BlockSpec((num_pages, ps, None), lambda bi, hi, si: (0, 0, hi))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, None, gp, d), lambda bi, hi, si: (bi, hi, 0, 0)),
            page_spec,
            page_spec,
            *([scale_spec, scale_spec] if quantized else []),
            pl.BlockSpec((None, None, per_split), lambda bi, hi, si: (bi, si, 0)),
            pl.BlockSpec((None, 1), lambda bi, hi, si: (bi, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda bi, hi, si: (si, bi, hi, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (si, bi, hi, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (si, bi, hi, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, kvh, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, kvh, gp), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, kvh, gp), jnp.float32),
        ],
        compiler_params=gpu_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_decode_gpu",
    )(qg, k_pages, v_pages, *((k_scales, v_scales) if quantized else ()), bt, context_lens.astype(jnp.int32)[:, None])
    out = combine_splits(acc, m, l)[:, :, :g]
    return out.reshape(b, h, d).astype(q.dtype)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split-K partial softmaxes: acc [S, ..., D] unnormalised, m/l [S, ...] their
    running max and sum. Rescale every split to the global max (log-sum-exp), then
    normalise once; splits that saw nothing have l == 0 and weigh nothing."""
    m_all = jnp.max(m, axis=0)
    w = jnp.where(l > 0, jnp.exp(m - m_all[None]), 0.0)
    num = jnp.sum(acc * w[..., None], axis=0)
    den = jnp.sum(l * w, axis=0)
    return normalise(num, den[..., None])


# -- public entry points --------------------------------------------------------------------


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    pages_per_block: int | None = None,
    kv_heads_per_block: int | None = None,
    pages_per_iter: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """One query per slot, q [B, H, D], over its pages -> [B, H, D] in q.dtype.

    k_pages/v_pages [num_pages, page_size, KVH, D] (int8 / float8 with k_scales/v_scales
    bfloat16 [num_pages, page_size, KVH]: widened and multiplied in per token in the kernel,
    float32 arithmetic); block_tables [B, P] int32 (entries past
    a slot's context must still be valid page indices; they are never attended);
    context_lens [B] (key j visible iff j < context_lens[b]).
    TPU knobs: pages_per_block (pages per grid step, default 128 tokens' worth),
    kv_heads_per_block. GPU knobs: pages_per_iter (pages per loop iteration, default 64
    tokens' worth), num_splits (default: enough programs to fill the GPU), num_warps,
    num_stages.
    """
    backend, interpret = resolve(backend, interpret)
    b, h, d = q.shape
    kvh = k_pages.shape[2]
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if backend == "tpu":
        return _paged_decode_tpu(
            q,
            k_pages,
            v_pages,
            block_tables,
            context_lens,
            scale=scale,
            pages_per_block=pages_per_block,
            interpret=interpret,
            kv_heads_per_block=kv_heads_per_block,
            k_scales=k_scales,
            v_scales=v_scales,
        )
    return _paged_decode_gpu(
        q,
        k_pages,
        v_pages,
        block_tables,
        context_lens,
        scale=scale,
        pages_per_iter=pages_per_iter,
        num_splits=num_splits,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        k_scales=k_scales,
        v_scales=v_scales,
    )
