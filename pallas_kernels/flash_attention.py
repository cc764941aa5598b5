"""Causal flash attention in Pallas: a tiled online softmax that never materialises the
[Tq, Tk] score matrix, with two lowerings behind one function.

* ``backend="tpu"`` (Mosaic style): the grid is (batch, kv heads, q blocks, kv blocks); the
  kv axis is sequential ("arbitrary") and the running max / sum / accumulator live in VMEM
  scratch across it. K/V blocks arrive through BlockSpecs, so Pallas pipelines their DMAs;
  the kv block index is clamped to the last block a q block can see, which turns the causal
  upper triangle into repeated indices (no DMA) and skipped steps (no compute).
* ``backend="gpu"`` (Triton style): the grid is (q blocks, batch, kv heads); each program
  holds its q tile in registers and walks the kv blocks with ``lax.fori_loop``, stopping at
  the last block any of its queries can see (causal early stop).

Both group the G = H // KVH query heads of one KV head in the same program, so every K/V
tile is read once per group instead of once per query head and K/V are never repeated in
memory. Scores and accumulators are float32 whatever the input dtype.

Masking model: query t of row b sits at absolute position ``q_positions[b, t]`` (by default
``q_offset[b] + t``); key j sits at position j. Key j is visible iff ``j <= q_positions[b, t]``,
``j < kv_lens[b]`` and (when given) the segment ids are equal. Keys at or beyond
``kv_lens[b]`` never touch the result, even if they hold NaN: their V rows are zeroed before
the PV product, because ``0 * NaN`` would otherwise poison the accumulator. A query that sees
no key gets zeros.

On the CPU, run with ``interpret=True`` (the default there); both lowerings interpret.
Only stable Pallas APIs are used (pallas_call, BlockSpec, PrefetchScalarGridSpec, VMEM
scratch, program_id/num_programs, pl.ds, pl.when, ref indexing) so the file works on jax
0.10 and 0.11.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

try:  # the Triton dialect module; absent from some minimal jaxlib builds
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

Backend = Literal["tpu", "gpu"]

# A finite "minus infinity": -inf would give inf - inf = NaN in the running-max correction
# of a row that has seen only masked keys so far.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# -- shared helpers -------------------------------------------------------------------------


def default_backend() -> Backend:
    """ "gpu" on CUDA/ROCm, else "tpu" (also the choice on CPU, where both interpret)."""
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"


def resolve(backend: str | None, interpret: bool | None) -> tuple[Backend, bool]:
    """Fill in the backend and interpret defaults: compile only where the platform runs that
    lowering natively (Triton on a GPU, Mosaic on a TPU), interpret everywhere else."""
    backend = backend or default_backend()
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
    if interpret is None:
        platform = jax.default_backend()
        native = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
        interpret = native != backend
    return backend, bool(interpret)


def tpu_compiler_params(dimension_semantics: tuple[str, ...]):
    """pltpu.CompilerParams under its current or older name; only read by the Mosaic lowering."""
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=dimension_semantics)


def gpu_compiler_params(num_warps: int, num_stages: int):
    """Triton launch parameters under the current or older class name."""
    if plgpu is None:  # pragma: no cover
        return None
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def _precision(a: jax.Array):
    # float32 inputs: full-precision passes (no TF32 / single bf16 pass), as the reference.
    return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b[N, K]^T in float32: the transposed operand is folded into the matmul
    (MXU / tensor cores) instead of materialising k.T."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a), preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a), preferred_element_type=jnp.float32)


def online_softmax_step(m_prev, l_prev, acc_prev, s, mask, v):
    """One block of the streaming softmax: fold scores s [R, C] (float32, already scaled)
    and values v [C, D] into the running max m [R, 1], sum l [R, 1] and accumulator
    acc [R, D]. Masked entries contribute exactly zero, even before the row has seen any
    visible key (when exp(s - m) would be exp(0) = 1)."""
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    l_new = l_prev * corr + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = acc_prev * corr + dot_nn(p.astype(v.dtype), v)
    return m_new, l_new, acc_new


def normalise(acc: jax.Array, l: jax.Array) -> jax.Array:
    """acc / l with rows that saw nothing (l == 0) left at zero."""
    return acc / jnp.where(l > 0, l, 1.0)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _block_sizes(
    backend: Backend, tq: int, tk: int, groups: int, block_q: int | None, block_k: int | None
) -> tuple[int, int]:
    """Effective tile sizes: the requested (or default) ones, shrunk for short sequences so a
    16-token prompt is not padded to a 128-row tile. Triton tiles are powers of two of at
    least 16 (tl.dot's minimum); Mosaic tiles are multiples of 8 sublanes."""
    if backend == "gpu":
        # Keep the G per-head accumulators of one program near 128 rows of registers.
        bq = block_q or max(16, 128 // _next_pow2(groups))
        bk = block_k or 64
        bq = min(_next_pow2(max(bq, 16)), max(16, _next_pow2(tq)))
        bk = min(_next_pow2(max(bk, 16)), max(16, _next_pow2(tk)))
    else:
        bq = min(_round_up(block_q or 128, 8), _round_up(tq, 8))
        bk = min(_round_up(block_k or 128, 8), _round_up(tk, 8))
    return bq, bk


# -- TPU (Mosaic) lowering ------------------------------------------------------------------


def _tpu_kernel(
    hi_ref,
    lens_ref,
    q_ref,
    k_ref,
    v_ref,
    qpos_ref,
    *rest,
    scale: float,
    groups: int,
    kv_heads: int,
    head_dim: int,
    block_k: int,
    num_q_blocks: int,
    has_segments: bool,
):
    """One (batch, kv-head block, q block, kv block) grid step.

    Scalar prefetch: hi_ref [B*nq] (how many kv blocks q block (b, i) needs), lens_ref [B].
    q_ref/o_ref [bq, kv_heads*G*D]: the query heads of this block's KV heads side by side
    in lanes; k_ref/v_ref [bk, kv_heads*D]; qpos_ref [bq, 1]; with segments
    qseg_ref [bq, 1] and kseg_ref [1, bk]. Scratch m/l [kv_heads*G, bq, 1] and
    acc [kv_heads*G, bq, D] carry the softmax state along the sequential kv axis.
    """
    if has_segments:
        qseg_ref, kseg_ref, o_ref, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, m_ref, l_ref, acc_ref = rest
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    d = head_dim

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(ki < hi_ref[b * num_q_blocks + qi])  # causal / length skip: no compute
    def _compute():
        bq = q_ref.shape[0]
        start = ki * block_k
        kpos_row = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        kpos_col = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        length = lens_ref[b]
        mask = (kpos_row < length) & (kpos_row <= qpos_ref[...])
        if has_segments:
            mask = mask & (qseg_ref[...] == kseg_ref[...])
        mask = jnp.broadcast_to(mask, (bq, block_k))
        key_ok = kpos_col < length
        for j in range(kv_heads):  # static
            k = k_ref[:, pl.ds(j * d, d)]
            v = v_ref[:, pl.ds(j * d, d)]
            v = jnp.where(key_ok, v, jnp.zeros_like(v))
            for g in range(groups):  # static: the query heads sharing this K/V tile
                r = j * groups + g
                s = dot_nt(q_ref[:, pl.ds(r * d, d)], k) * scale
                m, l, acc = online_softmax_step(m_ref[r], l_ref[r], acc_ref[r], s, mask, v)
                m_ref[r], l_ref[r], acc_ref[r] = m, l, acc

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        for r in range(kv_heads * groups):
            o_ref[:, pl.ds(r * d, d)] = normalise(acc_ref[r], l_ref[r]).astype(o_ref.dtype)


def tpu_kv_heads_per_block(head_dim: int, kv_heads: int, interpret: bool) -> int:
    """KV heads per grid step. Heads are addressed as lane blocks of the free reshape
    [..., KVH*D]: one head per step when D fills whole 128-lane vregs, else Mosaic needs the
    block to span the whole last dim, so all KV heads go in one step (no HBM transpose or
    head_dim padding of q/k/v either way). Interpret mode has no such rule."""
    return 1 if interpret or head_dim % 128 == 0 else kv_heads


def _flash_tpu(q, k, v, qpos, qseg, kseg, hi, kv_lens, *, scale, block_q, block_k, interpret, kv_heads_per_block):
    """q [B, Tq, H, D] etc. already padded to whole tiles."""
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    hb = kv_heads_per_block or tpu_kv_heads_per_block(d, kvh, interpret)
    if kvh % hb:
        raise ValueError(f"kv_heads_per_block {hb} must divide kv heads {kvh}")
    nq, nk = tq // block_q, tk // block_k
    has_segments = qseg is not None

    def kv_block(bi, qi, ki, hi_ref):
        # Past the last needed block, repeat it: Pallas skips the DMA of an unchanged block.
        return jnp.maximum(jnp.minimum(ki, hi_ref[bi * nq + qi] - 1), 0)

    q_spec = pl.BlockSpec((None, block_q, hb * g * d), lambda bi, hj, qi, ki, hr, lr: (bi, qi, hj))
    kv_spec = pl.BlockSpec((None, block_k, hb * d), lambda bi, hj, qi, ki, hr, lr: (bi, kv_block(bi, qi, ki, hr), hj))
    col_spec = pl.BlockSpec((None, block_q, 1), lambda bi, hj, qi, ki, hr, lr: (bi, qi, 0))
    in_specs = [q_spec, kv_spec, kv_spec, col_spec]
    args = [q.reshape(b, tq, h * d), k.reshape(b, tk, kvh * d), v.reshape(b, tk, kvh * d), qpos[:, :, None]]
    if has_segments:
        row_spec = pl.BlockSpec((None, 1, block_k), lambda bi, hj, qi, ki, hr, lr: (bi, 0, kv_block(bi, qi, ki, hr)))
        in_specs += [col_spec, row_spec]
        args += [qseg[:, :, None], kseg[:, None, :]]
    kernel = functools.partial(
        _tpu_kernel,
        scale=scale,
        groups=g,
        kv_heads=hb,
        head_dim=d,
        block_k=block_k,
        num_q_blocks=nq,
        has_segments=has_segments,
    )
    rows = hb * g
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh // hb, nq, nk),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((rows, block_q, 1), jnp.float32),
                pltpu.VMEM((rows, block_q, 1), jnp.float32),
                pltpu.VMEM((rows, block_q, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, tq, h * d), q.dtype),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="flash_attention_tpu",
    )(hi.reshape(-1), kv_lens, *args)
    return out.reshape(b, tq, h, d)


# -- GPU (Triton) lowering ------------------------------------------------------------------


def _gpu_kernel(
    q_ref, k_ref, v_ref, qpos_ref, bounds_ref, *rest, scale: float, groups: int, block_k: int, has_segments: bool
):
    """One (q block, batch, kv head) program.

    q_ref/o_ref [bq, G, D]; k_ref/v_ref [Tk, D] (the whole padded sequence of this KV head:
    a pointer, sliced per iteration); qpos_ref [bq]; bounds_ref [2] = (kv blocks needed,
    kv length); with segments qseg_ref [bq], kseg_ref [Tk].
    """
    if has_segments:
        qseg_ref, kseg_ref, o_ref = rest
    else:
        (o_ref,) = rest
    bq, _, d = q_ref.shape
    qpos = qpos_ref[...]
    hi, length = bounds_ref[0], bounds_ref[1]
    qs = [q_ref[:, g, :] for g in range(groups)]
    qseg = qseg_ref[...] if has_segments else None

    def body(i, carry):
        start = pl.multiple_of(i * block_k, block_k)
        kpos = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = kpos < length
        mask = valid[None, :] & (kpos[None, :] <= qpos[:, None])
        if has_segments:
            mask = mask & (qseg[:, None] == kseg_ref[pl.ds(start, block_k)][None, :])
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        out = []
        for g in range(groups):  # static: one K/V tile load serves the whole head group
            m, l, acc = carry[g]
            s = dot_nt(qs[g], k) * scale
            out.append(online_softmax_step(m, l, acc, s, mask, v))
        return tuple(out)

    init = tuple(
        (jnp.full((bq, 1), MASK_VALUE, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, d), jnp.float32))
        for _ in range(groups)
    )
    final = lax.fori_loop(0, hi, body, init)  # causal early stop: hi is this block's last visible kv block
    for g in range(groups):
        _, l, acc = final[g]
        o_ref[:, g, :] = normalise(acc, l).astype(o_ref.dtype)


def _flash_gpu(q, k, v, qpos, qseg, kseg, hi, kv_lens, *, scale, block_q, block_k, interpret, num_warps, num_stages):
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    nq = tq // block_q
    has_segments = qseg is not None
    bounds = jnp.stack([hi, jnp.broadcast_to(kv_lens[:, None], hi.shape)], axis=-1)  # [B, nq, 2]
    in_specs = [
        pl.BlockSpec((None, block_q, g, d), lambda qi, bi, hi_: (bi, qi, hi_, 0)),
        pl.BlockSpec((None, tk, None, d), lambda qi, bi, hi_: (bi, 0, hi_, 0)),
        pl.BlockSpec((None, tk, None, d), lambda qi, bi, hi_: (bi, 0, hi_, 0)),
        pl.BlockSpec((None, block_q), lambda qi, bi, hi_: (bi, qi)),
        pl.BlockSpec((None, None, 2), lambda qi, bi, hi_: (bi, qi, 0)),
    ]
    args = [q, k, v, qpos, bounds]
    if has_segments:
        in_specs += [
            pl.BlockSpec((None, block_q), lambda qi, bi, hi_: (bi, qi)),
            pl.BlockSpec((None, tk), lambda qi, bi, hi_: (bi, 0)),
        ]
        args += [qseg, kseg]
    kernel = functools.partial(_gpu_kernel, scale=scale, groups=g, block_k=block_k, has_segments=has_segments)
    return pl.pallas_call(
        kernel,
        grid=(nq, b, kvh),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, g, d), lambda qi, bi, hi_: (bi, qi, hi_, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=gpu_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_attention_gpu",
    )(*args)


# -- public entry point ---------------------------------------------------------------------


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None = None,
    q_offset: jax.Array | int | None = None,
    q_positions: jax.Array | None = None,
    kv_lens: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    kv_heads_per_block: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention of q [B, Tq, H, D] over k, v [B, Tk, KVH, D].

    q_offset [B] (or an int): absolute position of each row's first query, for a chunk that
      continues a sequence whose earlier keys are in k/v (chunked prefill, prefix-cache
      hit). q_positions [B, Tq] gives every query's position instead (padding may be
      anything; a negative position sees nothing).
    kv_lens [B]: keys at or beyond are padding and never read into the result.
    segment_ids [B, Tq] / kv_segment_ids [B, Tk]: packed prompts; a query sees only keys of
      its own segment (kv_segment_ids defaults to segment_ids when Tq == Tk).
    block_q / block_k: tile sizes (shrunk for short inputs; defaults per backend).
    num_warps / num_stages: Triton launch parameters (GPU lowering only).
    kv_heads_per_block: KV heads per TPU grid step (default: 1 when head_dim is a multiple
      of 128 or in interpret mode, else all of them; see tpu_kv_heads_per_block).
    backend: "tpu" or "gpu" lowering (default by jax.default_backend()); interpret defaults
      to False only where the platform runs that lowering natively.
    Returns [B, Tq, H, D] in q.dtype.
    """
    backend, interpret = resolve(backend, interpret)
    b, tq, h, d = q.shape
    _, tk, kvh, _ = k.shape
    if h % kvh:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
    if v.shape != k.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ")
    if q_offset is not None and q_positions is not None:
        raise ValueError("pass q_offset or q_positions, not both")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    groups = h // kvh
    bq, bk = _block_sizes(backend, tq, tk, groups, block_q, block_k)
    tq_pad, tk_pad = _round_up(tq, bq), _round_up(tk, bk)
    nq = tq_pad // bq

    if q_positions is None:
        offset = (
            jnp.zeros((b,), jnp.int32) if q_offset is None else jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (b,))
        )
        q_positions = offset[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
    qpos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tq_pad - tq)), constant_values=-1)
    kv_lens = jnp.full((b,), tk, jnp.int32) if kv_lens is None else jnp.minimum(kv_lens.astype(jnp.int32), tk)
    # Number of kv blocks each q block needs: up to its last query's position (causal early
    # stop) and never past the row's length.
    last = jnp.max(qpos.reshape(b, nq, bq), axis=-1)
    visible = jnp.clip(jnp.minimum(last + 1, kv_lens[:, None]), 0, None)
    hi = ((visible + bk - 1) // bk).astype(jnp.int32)

    qseg = kseg = None
    if segment_ids is not None:
        if kv_segment_ids is None:
            if tq != tk:
                raise ValueError("kv_segment_ids is required when Tq != Tk")
            kv_segment_ids = segment_ids
        qseg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tq_pad - tq)))
        kseg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, tk_pad - tk)))

    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0))) if n != x.shape[1] else x
    qp, kp, vp = pad(q, tq_pad), pad(k, tk_pad), pad(v, tk_pad)
    if backend == "tpu":
        out = _flash_tpu(
            qp,
            kp,
            vp,
            qpos,
            qseg,
            kseg,
            hi,
            kv_lens,
            scale=scale,
            block_q=bq,
            block_k=bk,
            interpret=interpret,
            kv_heads_per_block=kv_heads_per_block,
        )
    else:
        warps = num_warps or (4 if d <= 64 else 8)
        out = _flash_gpu(
            qp,
            kp,
            vp,
            qpos,
            qseg,
            kseg,
            hi,
            kv_lens,
            scale=scale,
            block_q=bq,
            block_k=bk,
            interpret=interpret,
            num_warps=warps,
            num_stages=num_stages,
        )
    return out[:, :tq]
