"""Greedy sampling's argmax on the CPU through XLA FFI (``cpu/argmax.cc``, built into the same
shared library as the attention kernel by ``native``).

``argmax(logits)``: float32 [S, V] -> int32 [S], the first index of each row's maximum, the same
ids as ``jaxserve.runner.sampling.argmax`` (which is the oracle in the tests) in one pass over
the logits: XLA:CPU makes two of that function's reductions, 0.27 ms at 8 rows x 32,000 here.
A row holding a NaN gets some id in [0, V). Inside or outside ``jax.jit``; the custom call
cannot be split across chips, so the model runner uses it only on the CPU without a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native

TARGET = "jaxserve_argmax"
ABI_VERSION = 1  # must match jaxserve_argmax_abi_version() in cpu/argmax.cc

_kernels = native.MoreKernels(
    "argmax", "jaxserve_argmax_abi_version", ABI_VERSION, {TARGET: "JaxserveArgmax"}, "XLA's reductions will be used"
)
available = _kernels.available  # True when the native argmax is built, loaded and registered (CPU only)
unavailable_reason = _kernels.unavailable_reason


def argmax(logits) -> jax.Array:
    """logits [S, V] (cast to float32) -> int32 [S], in the native kernel."""
    logits = jnp.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax: logits must be [S, V] with V >= 1, got {logits.shape}")
    if not available():
        raise RuntimeError(f"the native argmax is unavailable: {unavailable_reason()}")
    out = jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out)(logits.astype(jnp.float32))
