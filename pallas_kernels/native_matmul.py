"""Weight-only int8 matmul on the CPU through XLA FFI, with its jnp reference.

``int8_matmul(x, w, scale)`` computes ``y[..., n] = scale[n] * sum_k x[..., k] * w[n, k]``:
x [..., K] float32, w [N, K] int8 (one row per output channel), scale [N] float32; the result is
float32 [..., N]. Inside or outside ``jax.jit`` (not under ``vmap``). The C++ kernel
(``cpu/int8_matmul.cc``, in the same shared library as the paged-attention kernel, built and
loaded by ``native``) widens the int8 weights in registers as it streams them: the step reads one
byte per weight and never holds a float copy of them. Where the library is unavailable (not the
CPU, no compiler) ``int8_matmul`` computes ``reference`` instead, which XLA runs by converting the
weights to float32 first.
"""

from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

TARGET = "jaxserve_int8_matmul"
ABI_VERSION = 1  # must match jaxserve_int8_matmul_abi_version() in cpu/int8_matmul.cc

_lock = threading.Lock()
_state: dict = {}


def available() -> bool:
    """True when the native int8 matmul is built, loaded and registered with XLA (CPU only)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        ok = False
        lib = native._load()  # noqa: SLF001 - the one loader of the shared library
        if lib is None:
            _state["error"] = native.unavailable_reason()
        else:
            try:
                lib.jaxserve_int8_matmul_abi_version.restype = ctypes.c_int
                if lib.jaxserve_int8_matmul_abi_version() != ABI_VERSION:
                    raise RuntimeError(
                        f"int8 matmul ABI {lib.jaxserve_int8_matmul_abi_version()}, expected {ABI_VERSION}"
                    )
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveInt8Matmul), platform="cpu")
                ok = True
            except Exception as e:  # a library built without this kernel: use the reference
                _state["error"] = f"{type(e).__name__}: {e}"
                native.log.warning("native int8 matmul unavailable, XLA will dequantize: %s", _state["error"])
        _state["ok"] = ok
        return ok


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")


def reference(x, w, scale):
    """The oracle: x @ float32(w).T * scale, in float32 (XLA converts the weights first)."""
    x = jnp.asarray(x, jnp.float32)
    y = jax.lax.dot_general(
        x, jnp.asarray(w).astype(jnp.float32), (((x.ndim - 1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST
    )
    return y * jnp.asarray(scale, jnp.float32)


def int8_matmul(x, w, scale):
    """x [..., K] @ (w [N, K] int8 * scale [N])^T -> float32 [..., N], in the native kernel where
    ``available()``, else ``reference``."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        x = x.astype(jnp.float32)
    if w.dtype != jnp.int8 or w.ndim != 2 or x.shape[-1] != w.shape[1] or scale.shape != (w.shape[0],):
        raise ValueError(
            f"int8_matmul: x [..., K] float, w [N, K] int8, scale [N]; got x {x.shape}, w {w.shape} {w.dtype}, "
            f"scale {scale.shape}"
        )
    if not available():
        return reference(x, w, scale)
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    rows = int(np.prod(lead, dtype=np.int64))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32))
    y = call(x.reshape(rows, k), w, jnp.asarray(scale, jnp.float32))
    return y.reshape(*lead, n)
