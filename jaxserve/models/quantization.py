"""Weight-only int8 quantization: per-output-channel symmetric scales.

For a weight matrix stored as transformers stores it, ``w [out, in]`` (one row per output
channel), and every output channel j:

    scale[j] = max_i |w[j, i]| / 127          (float32)
    q[j, i]  = clip(round(w[j, i] / scale[j]), -127, 127)   (int8, round half to even)

and ``q[j, i] * scale[j]`` is the dequantized weight, within ``scale[j] / 2`` of ``w[j, i]``.
A row of zeros gets scale 0 and q 0. All arithmetic is float32 (a bfloat16 checkpoint is widened
first), computed in NumPy at load time; tests/test_quantization.py checks them against a reference.

The matmul with such a weight is ``int8_matmul``, XLA's dot of the converted weights: on TPU/GPU
XLA fuses the conversion into the dot. On the CPU XLA writes a float32 copy of the weights first,
so there the runner packs the int8 weights for the native kernel instead
(``models.linear.Linear.pack_native``, ``pallas_kernels.native_matmul``), which widens them in
registers as it streams them; XLA's form remains for tensor parallelism.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = (None, "int8")
INT8_MAX = 127


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


def int8_matmul(x, q, scale) -> jax.Array:
    """x [..., in] @ dequantize(q [out, in], scale [out]).T -> [..., out] in x's dtype, by XLA."""
    y = jax.lax.dot_general(x, q.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)
