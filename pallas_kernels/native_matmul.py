"""The projections' matmul on the CPU through XLA FFI, from weights packed into panels.

A decode step multiplies a few rows by every weight, so it has to stream the weights once at
memory speed; XLA:CPU's GEMM reads them at 12-14 GB/s from 8 rows up (30 GB/s for one row) on the
development machine. ``cpu/matmul.cc`` (built into the same shared library as the attention
kernel by ``native``) reads weights packed once at load into panels of ``PANEL`` columns, each
panel [K, 64] contiguous: the whole array is [P, K, 64], P = ceil(N / 64), zero-padded past N.

- ``pack(w)``: float32 kernel [K, N] (the layout ``models.linear`` holds) -> [P, K, 64].
- ``pack_int8(q, scale)``: int8 weights [N, K] (one row per output channel, as quantized at load)
  and their per-channel scales [N] -> int8 [P, K, 64] with each row's 64 bytes interleaved (byte
  4i + j holds column 16j + i: what the kernel's widening reads in order) and scales [P * 64].
- ``pack_bf16(w)``: float32 kernel [K, N] -> bfloat16 [P, ceil(K / 32), 2048]: each panel cut along
  K into blocks of 32, each block [16 k pairs][64 columns][2] (row kk of AMX weight tile j, the
  VNNI pairs TDPBF16PS reads, is columns 16j..16j+15 of k pair kk: a strided tile load; a k
  pair's 64 columns are contiguous for the dot-product path); zero-padded past K and N. Runs
  on AMX or AVX512-BF16 (``bf16_units()``) and, widened to float32 in registers (half of
  float32's bytes, float32 FMAs), on AVX2 and AVX-512 (``bf16_available()``); x is rounded to
  bfloat16 in the kernel, products and sums are float32.
- ``pack_int8_bf16(q, scale)``: int8 weights [N, K] and scales [N] -> int8 [P, ceil(K / 32), 2048]
  in ``pack_bf16``'s element order, scales [P * 64]: weight-only int8 on the bfloat16 units
  (W8A16). The kernel widens the int8 values to bfloat16 (exact: 8 significant bits) and runs
  the bfloat16 dot products (x rounded to bfloat16 as for ``pack_bf16``), each column's scale
  applied to its sums. Half the bytes of bfloat16 panels, the bfloat16 units' arithmetic
  (``bf16_units()`` only: other hosts pack int8 with ``pack_int8``).
- ``matmul(x, w, scale, n=N)``: x [..., K] float32 -> float32 [..., N]; int8 panels need scale.
- ``reference``: the same from the unpacked weights in jnp, the oracle.
- ``grouped_matmul(x, w, scale, group_sizes, n=N)``: a mixture-of-experts layer's experts in one
  call: x [M, K] with its rows sorted by group, w [G, ...] G weights each packed by one of the
  functions above (``pack_stack``), group g's rows multiplied by w[g]; rows past every group are
  zeros. Groups without rows cost nothing. ``grouped_reference`` is its oracle.

Inside or outside ``jax.jit`` (not under ``vmap``). Where the library is unavailable (not the
CPU, no compiler) ``available()`` is False and nothing should be packed: ``models.linear`` keeps
its XLA layout then.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

PANEL = 64  # columns per panel (kPanel in cpu/matmul.cc)
TARGET_F32 = "jaxserve_matmul_f32"
TARGET_Q8 = "jaxserve_matmul_q8"
TARGET_BF16 = "jaxserve_matmul_bf16"
TARGET_Q8_BF16 = "jaxserve_matmul_q8_bf16"
GROUPED_TARGETS = {  # (weights' dtype, pair layout) -> the grouped matmul's FFI target
    ("float32", False): "jaxserve_grouped_matmul_f32",
    ("int8", False): "jaxserve_grouped_matmul_q8",
    ("bfloat16", True): "jaxserve_grouped_matmul_bf16",
    ("int8", True): "jaxserve_grouped_matmul_q8_bf16",
}
K_BLOCK = 32  # k per AMX tile step (kKBlock in cpu/matmul.cc)
TILE_COLS = 16  # columns per AMX weight tile
ABI_VERSION = 7  # must match jaxserve_matmul_abi_version() in cpu/matmul.cc

_kernels = native.MoreKernels(
    "matmul",
    "jaxserve_matmul_abi_version",
    ABI_VERSION,
    {
        TARGET_F32: "JaxserveMatmulF32",
        TARGET_Q8: "JaxserveMatmulQ8",
        TARGET_BF16: "JaxserveMatmulBF16",
        TARGET_Q8_BF16: "JaxserveMatmulQ8BF16",
        GROUPED_TARGETS["float32", False]: "JaxserveGroupedMatmulF32",
        GROUPED_TARGETS["int8", False]: "JaxserveGroupedMatmulQ8",
        GROUPED_TARGETS["bfloat16", True]: "JaxserveGroupedMatmulBF16",
        GROUPED_TARGETS["int8", True]: "JaxserveGroupedMatmulQ8BF16",
    },
    "XLA's dot will be used",
)
available = _kernels.available  # True when the native matmul is built, loaded and registered (CPU only)
unavailable_reason = _kernels.unavailable_reason


def bf16_available() -> bool:
    """True when bfloat16 panels (``pack_bf16``) run in the native kernel here: the kernels are
    built and the CPU has AVX2 or better, not turned off (JAXSERVE_CPU_ISA or
    ``native.set_cpu_isa``). Below AVX512-BF16 the weights widen to float32 in registers: half
    float32's bytes, float32 arithmetic (``bf16_units()`` says which)."""
    return available() and native.cpu_isa() in native.BF16_WEIGHT_ISAS


def bf16_units() -> bool:
    """True when the CPU computes in bfloat16 (AVX512-BF16 dot products or the AMX tiles) and
    they are on: where bfloat16 is the engine's default precision, and where int8 weights run as
    W8A16 in the pair layout (``pack_int8_bf16``)."""
    return available() and native.cpu_isa() in native.BF16_ISAS


def bf16_unavailable_reason() -> str | None:
    """Why bfloat16 panels do not run natively here (None where they do)."""
    return _why_not(bf16_available(), native.BF16_WEIGHT_ISAS, "AVX2")


def bf16_units_missing_reason() -> str | None:
    """Why the CPU does not compute in bfloat16 here (None where it does)."""
    return _why_not(bf16_units(), native.BF16_ISAS, "AMX / AVX512-BF16")


def _why_not(ok: bool, isas, needs: str) -> str | None:
    if ok:
        return None
    if not available():
        return unavailable_reason()
    best = native.best_cpu_isa()
    if best in isas:
        return f"{needs} turned off (JAXSERVE_CPU_ISA or native.set_cpu_isa; the host has {best})"
    return f"this CPU lacks {needs} (best instruction set: {best})"


def num_panels(n: int) -> int:
    return -(-n // PANEL)


def _panels(w_kn: np.ndarray) -> np.ndarray:
    """[K, N] -> [P, K, 64], zero-padded past N."""
    k, n = w_kn.shape
    pad = num_panels(n) * PANEL - n
    w_kn = np.pad(w_kn, ((0, 0), (0, pad)))
    return np.ascontiguousarray(w_kn.reshape(k, -1, PANEL).transpose(1, 0, 2))


def pack(w) -> np.ndarray:
    """float32 kernel [K, N] -> float32 panels [P, K, 64] (on the host, once at load)."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"pack: a float32 kernel [K, N], got {w.shape} {w.dtype}")
    return _panels(w)


def pack_int8(q, scale) -> tuple[np.ndarray, np.ndarray]:
    """int8 weights [N, K] and scales [N] -> interleaved int8 panels [P, K, 64], scales [P * 64]."""
    q, scale = np.asarray(q), np.asarray(scale)
    if q.ndim != 2 or q.dtype != np.int8 or scale.shape != (q.shape[0],):
        raise ValueError(f"pack_int8: int8 [N, K] and scales [N], got {q.shape} {q.dtype}, {scale.shape}")
    p = _panels(q.T)
    p = p.reshape(*p.shape[:2], 4, 16).transpose(0, 1, 3, 2).reshape(p.shape)  # byte 4i + j <- column 16j + i
    s = np.pad(scale.astype(np.float32), (0, p.shape[0] * PANEL - scale.shape[0]))
    return np.ascontiguousarray(p), s


def _pairs(w_kn: np.ndarray) -> np.ndarray:
    """[K, N] (any dtype) -> [P, ceil(K / 32), 2048] in the AMX pair order, zero-padded."""
    k, _ = w_kn.shape
    kb = -(-k // K_BLOCK)
    p = _panels(np.pad(w_kn, ((0, kb * K_BLOCK - k), (0, 0))))  # [P, KB * 32, 64]
    p = p.reshape(p.shape[0], kb, K_BLOCK // 2, 2, PANEL // TILE_COLS, TILE_COLS)  # [P, kb, kk, e, j, c]
    p = p.transpose(0, 1, 2, 4, 5, 3)  # [P, kb, kk, j, c, e]
    return np.ascontiguousarray(p.reshape(p.shape[0], kb, K_BLOCK * PANEL))


def pack_bf16(w) -> np.ndarray:
    """float32 kernel [K, N] -> bfloat16 panels [P, ceil(K / 32), 2048] (rounded to nearest
    even; on the host, once at load): element [p, kb, 128 kk + 32 j + 2 c + e] is
    w[32 kb + 2 kk + e, 64 p + 16 j + c]."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"pack_bf16: a float32 kernel [K, N], got {w.shape} {w.dtype}")
    return _pairs(w.astype(jnp.bfloat16))


def pack_int8_bf16(q, scale) -> tuple[np.ndarray, np.ndarray]:
    """int8 weights [N, K] and scales [N] -> int8 [P, ceil(K / 32), 2048] (for the bfloat16
    units, widened in the kernel), scales [P * 64]. Each (panel, k block) holds the same weights
    as pack_bf16's, but a k pair's 128 bytes are ordered for widening by in-lane shifts: byte
    [p, kb, 128 kk + 64 l + 4 i + b] is q[64 p + 16 (2 l + b // 2) + 8 (b % 2) + i // 2, 32 kb + 2 kk + i % 2]."""
    q, scale = np.asarray(q), np.asarray(scale)
    if q.ndim != 2 or q.dtype != np.int8 or scale.shape != (q.shape[0],):
        raise ValueError(f"pack_int8_bf16: int8 [N, K] and scales [N], got {q.shape} {q.dtype}, {scale.shape}")
    k, _ = q.shape[1], q.shape[0]
    kb = -(-k // K_BLOCK)
    p = _panels(np.pad(q.T, ((0, kb * K_BLOCK - k), (0, 0))))  # [P, KB * 32, 64]
    # [P, kb, kk, e, (l, hb, hh, ci)] -> [P, kb, kk, l, (ci, e), (hb, hh)]: cpu/matmul.cc widen_pair_row
    p = p.reshape(p.shape[0], kb, K_BLOCK // 2, 2, 2, 2, 2, 8).transpose(0, 1, 2, 4, 7, 3, 5, 6)
    p = np.ascontiguousarray(p.reshape(p.shape[0], kb, K_BLOCK * PANEL))
    return p, np.pad(scale.astype(np.float32), (0, p.shape[0] * PANEL - scale.shape[0]))


def pair_layout(w) -> bool:
    """Panels in the AMX pair layout [P, ceil(K / 32), 2048]: bfloat16, or int8 for the bfloat16
    units (the int8 panels for float32 arithmetic are [P, K, 64])."""
    return w.ndim == 3 and (w.dtype == jnp.bfloat16 or (w.dtype == jnp.int8 and w.shape[2] == K_BLOCK * PANEL))


def unpack(w, n: int, k: int | None = None) -> jax.Array:
    """Panels back to the [K, N] matrix (float32; int8 panels as their int8 values, unscaled;
    pair-layout panels need K, padded there to a multiple of 32)."""
    w = jnp.asarray(w)
    if pair_layout(w) and w.dtype == jnp.int8:
        p, kb, _ = w.shape
        w = w.reshape(p, kb, K_BLOCK // 2, 2, 8, 2, 2, 2).transpose(
            1, 2, 5, 0, 3, 6, 7, 4
        )  # [kb, kk, e, P, l, hb, hh, ci]
        return w.reshape(kb * K_BLOCK, p * PANEL)[:k, :n].astype(jnp.float32)
    if pair_layout(w):
        p, kb, _ = w.shape
        w = w.reshape(p, kb, K_BLOCK // 2, PANEL // TILE_COLS, TILE_COLS, 2).transpose(1, 2, 5, 0, 3, 4)
        return w.reshape(kb * K_BLOCK, p * PANEL)[:k, :n].astype(jnp.float32)
    if w.dtype == jnp.int8:
        w = w.reshape(*w.shape[:2], 16, 4).transpose(0, 1, 3, 2).reshape(w.shape)
    p, k, _ = w.shape
    return w.transpose(1, 0, 2).reshape(k, p * PANEL)[:, :n].astype(jnp.float32)


def reference(x, w, scale=None, *, n: int) -> jax.Array:
    """The oracle: x @ unpack(w) (* scale), in float32, by XLA (x rounded to bfloat16 first
    for pair-layout panels, bfloat16 or int8, as the kernel does)."""
    x = jnp.asarray(x, jnp.float32)
    if pair_layout(w):
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    y = jax.lax.dot_general(
        x, unpack(w, n, x.shape[-1]), (((x.ndim - 1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST
    )
    if scale is not None:
        y = y * jnp.asarray(scale, jnp.float32)[:n]
    return y


def matmul(x, w, scale=None, *, n: int, live_rows=None) -> jax.Array:
    """x [..., K] @ panels w -> float32 [..., n] in the native kernel (``reference`` where it is
    unavailable; for bfloat16 panels, where the AMX tiles are off). Float32 and bfloat16 panels
    take no scale; int8 panels need theirs ([P * 64]). live_rows (an int32 scalar, may be
    traced): only the first live_rows rows of x (flattened) are multiplied, the rest of y is
    zero: a ragged step's padding tokens cost nothing (the reference computes every row)."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        x = x.astype(jnp.float32)
    q8 = w.dtype == jnp.int8
    pairs = pair_layout(w)  # bfloat16, or int8 for the bfloat16 units
    k_rows, width = (-(-x.shape[-1] // K_BLOCK), K_BLOCK * PANEL) if pairs else (x.shape[-1], PANEL)
    if (
        w.ndim != 3
        or w.shape[2] != width
        or w.shape[1] != k_rows
        or num_panels(n) != w.shape[0]
        or w.dtype not in (jnp.float32, jnp.int8, jnp.bfloat16)
        or (scale is None) == q8
        or (q8 and scale.shape != (w.shape[0] * PANEL,))
    ):
        raise ValueError(
            f"matmul: x [..., K] float, w [ceil(n / {PANEL}), K, {PANEL}] float32 or int8 (with scale "
            f"[P * {PANEL}]), or bfloat16 or int8 (with scale) [ceil(n / {PANEL}), ceil(K / {K_BLOCK}), "
            f"{K_BLOCK * PANEL}]; got x {x.shape}, w {w.shape} {w.dtype}, scale "
            f"{None if scale is None else scale.shape}, n {n}"
        )
    native_ok = (bf16_units() if q8 else bf16_available()) if pairs else available()
    if not native_ok:
        return reference(x, w, scale, n=n)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    live = jnp.zeros((0,), jnp.int32) if live_rows is None else jnp.reshape(jnp.asarray(live_rows, jnp.int32), (1,))
    x2 = x.reshape(rows, k)
    if q8:
        target = TARGET_Q8_BF16 if pairs else TARGET_Q8
        y = jax.ffi.ffi_call(target, out)(x2, w, jnp.asarray(scale, jnp.float32), live)
    elif pairs:
        y = jax.ffi.ffi_call(TARGET_BF16, out)(x2, w, live)
    else:
        y = jax.ffi.ffi_call(TARGET_F32, out)(x2, w, live)
    return y.reshape(*lead, n)


def pack_stack(pack_one, *stacks) -> tuple[np.ndarray, ...] | np.ndarray:
    """Pack each of G weights with ``pack_one`` (one of the pack functions above, given the g-th
    slice of every stack) and stack the results: [G, ...] packed weights (and [G, P * 64] scales
    for int8) for ``grouped_matmul``."""
    parts = [pack_one(*(np.asarray(s[g]) for s in stacks)) for g in range(len(stacks[0]))]
    if isinstance(parts[0], tuple):
        return tuple(np.stack(p) for p in zip(*parts, strict=True))
    return np.stack(parts)


def _group_ids(group_sizes, m: int) -> jax.Array:
    """Each of m rows' group (G for the rows past every group)."""
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m), side="right")


def grouped_reference(x, w, scale=None, group_sizes=None, *, n: int) -> jax.Array:
    """The oracle of ``grouped_matmul``: every row times every group's unpacked weights by XLA
    (``reference``), each row keeping its own group's product; zeros past the groups."""
    x = jnp.asarray(x, jnp.float32)
    g = w.shape[0]
    every = jnp.stack([reference(x, w[i], None if scale is None else scale[i], n=n) for i in range(g)])  # [G, M, n]
    ids = _group_ids(group_sizes, x.shape[0])
    picked = jnp.take_along_axis(every, jnp.minimum(ids, g - 1)[None, :, None], axis=0)[0]
    return jnp.where((ids < g)[:, None], picked, 0.0)


def grouped_matmul(x, w, scale, group_sizes, *, n: int) -> jax.Array:
    """x [M, K] float (rows sorted by group) -> float32 [M, n]: group g's group_sizes[g] rows
    (after those of the groups before it) times w[g]; the rows past every group are zeros.
    w: [G, ...] packed weights (``pack_stack``) of any layout ``matmul`` takes, scale [G, P * 64]
    for int8 (None otherwise); group_sizes [G] int32 (may be traced). The native kernel where it
    runs the layout here, ``grouped_reference`` elsewhere."""
    x = jnp.asarray(x, jnp.float32)
    q8 = w.dtype == jnp.int8
    pairs = w.ndim == 4 and pair_layout(w[0])
    k_rows, width = (-(-x.shape[-1] // K_BLOCK), K_BLOCK * PANEL) if pairs else (x.shape[-1], PANEL)
    if (
        x.ndim != 2
        or w.ndim != 4
        or w.shape[2:] != (k_rows, width)
        or num_panels(n) != w.shape[1]
        or (scale is None) == q8
        or (q8 and scale.shape != (w.shape[0], w.shape[1] * PANEL))
        or jnp.shape(group_sizes) != (w.shape[0],)
    ):
        raise ValueError(
            f"grouped_matmul: x [M, K], w [G, ceil(n / {PANEL}), K, {PANEL}] or [G, ceil(n / {PANEL}), "
            f"ceil(K / {K_BLOCK}), {K_BLOCK * PANEL}] (int8 with scale [G, P * {PANEL}]), group_sizes [G]; "
            f"got x {x.shape}, w {w.shape} {w.dtype}, scale {None if scale is None else scale.shape}, "
            f"group_sizes {jnp.shape(group_sizes)}, n {n}"
        )
    native_ok = (bf16_units() if q8 else bf16_available()) if pairs else available()
    if not native_ok:
        return grouped_reference(x, w, scale, group_sizes, n=n)
    target = GROUPED_TARGETS[jnp.dtype(w.dtype).name, pairs]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    if q8:
        return jax.ffi.ffi_call(target, out)(x, w, jnp.asarray(scale, jnp.float32), sizes)
    return jax.ffi.ffi_call(target, out)(x, w, sizes)
