"""Greedy sampling's argmax on the CPU through XLA FFI (``cpu/argmax.cc``, built into the same
shared library as the attention kernel by ``native``).

``argmax(logits)``: float32 [S, V] -> int32 [S], the first index of each row's maximum, the same
ids as ``jaxserve.runner.sampling.argmax`` (which is the oracle in the tests) in one pass over
the logits: XLA:CPU makes two of that function's reductions, 0.27 ms at 8 rows x 32,000 here.
A row holding a NaN gets some id in [0, V). Inside or outside ``jax.jit``; the custom call
cannot be split across chips, so the model runner uses it only on the CPU without a mesh.
"""

from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp

from pallas_kernels import native

TARGET = "jaxserve_argmax"
ABI_VERSION = 1  # must match jaxserve_argmax_abi_version() in cpu/argmax.cc

_lock = threading.Lock()
_state: dict = {}


def available() -> bool:
    """True when the native argmax is built, loaded and registered with XLA (CPU only)."""
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
                lib.jaxserve_argmax_abi_version.restype = ctypes.c_int
                if lib.jaxserve_argmax_abi_version() != ABI_VERSION:
                    raise RuntimeError(f"argmax ABI {lib.jaxserve_argmax_abi_version()}, expected {ABI_VERSION}")
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveArgmax), platform="cpu")
                ok = True
            except Exception as e:  # a library built without this kernel: XLA's reductions instead
                _state["error"] = f"{type(e).__name__}: {e}"
                native.log.warning("native argmax unavailable, XLA's will be used: %s", _state["error"])
        _state["ok"] = ok
        return ok


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")


def argmax(logits) -> jax.Array:
    """logits [S, V] (cast to float32) -> int32 [S], in the native kernel."""
    logits = jnp.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax: logits must be [S, V] with V >= 1, got {logits.shape}")
    if not available():
        raise RuntimeError(f"the native argmax is unavailable: {unavailable_reason()}")
    out = jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out)(logits.astype(jnp.float32))
