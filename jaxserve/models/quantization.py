"""Weight-only int8 quantization: per-output-channel symmetric scales.

For a weight matrix stored as transformers stores it, ``w [out, in]`` (one row per output
channel), and every output channel j:

    scale[j] = max_i |w[j, i]| / 127          (float32)
    q[j, i]  = clip(round(w[j, i] / scale[j]), -127, 127)   (int8, round half to even)

and ``q[j, i] * scale[j]`` is the dequantized weight, within ``scale[j] / 2`` of ``w[j, i]``.
A row of zeros gets scale 0 and q 0. All arithmetic is float32 (a bfloat16 checkpoint is widened
first), computed in NumPy at load time; tests/test_quantization.py checks them against a reference.

The matmul with such a weight is ``int8_matmul``: the native CPU kernel for small row counts
(decode), where it streams one byte per weight; XLA otherwise (TPU/GPU, large prefill chunks on
the CPU, tensor parallelism), which converts the weights inside its own fusion or, on the CPU,
into a temporary before the dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = (None, "int8")
INT8_MAX = 127
# Up to this many rows (tokens) the native kernel beats XLA's dequantize-then-dot on the CPU
# (measured with scripts/bench_quant.py --matmul: decode batches; prefill chunks go to XLA).
NATIVE_MAX_ROWS = 64


def check_mode(quantization) -> None:
    if quantization not in MODES:
        raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")


def int8_scales(w) -> np.ndarray:
    """float32 [out]: max |w| over the input dimension (the last), / 127."""
    amax = np.max(np.abs(np.asarray(w).astype(np.float32)), axis=-1)
    return (amax / np.float32(INT8_MAX)).astype(np.float32)


def quantize_int8(w) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] (any float dtype, host or device) -> (q int8 [out, in], scale float32 [out]).

    On the host in NumPy, at load time: XLA may turn a division by a constant into a
    multiplication by its reciprocal, which is not always the same float32."""
    w = np.asarray(w).astype(np.float32)
    scale = int8_scales(w)
    safe = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    q = np.clip(np.rint(w / safe[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def dequantize_int8(q, scale, dtype=jnp.float32) -> jax.Array:
    return (jnp.asarray(q).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)[..., None]).astype(dtype)


def int8_matmul(x, q, scale, *, impl: str = "auto") -> jax.Array:
    """x [..., in] @ dequantize(q [out, in], scale [out]).T -> [..., out] in x's dtype.

    impl "auto": the native kernel on the CPU for float32 x with at most NATIVE_MAX_ROWS rows
    (decided from the static shape at trace time), else XLA; "native" forces the kernel where it
    is available; "xla" never uses it (the kernel is a custom call that XLA's partitioner cannot
    split, so a tensor-parallel model uses this)."""
    if impl not in ("auto", "native", "xla"):
        raise ValueError(f"impl must be 'auto', 'native' or 'xla', got {impl!r}")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if impl != "xla" and x.dtype == jnp.float32 and jax.default_backend() == "cpu":
        from pallas_kernels import native_matmul

        if (impl == "native" or rows <= NATIVE_MAX_ROWS) and native_matmul.available():
            return native_matmul.int8_matmul(x, q, scale)
    y = jax.lax.dot_general(x, q.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)
