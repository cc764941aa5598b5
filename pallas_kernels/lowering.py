"""Which Pallas lowering a kernel takes, and each lowering's launch parameters.

A Pallas kernel here has two lowerings behind one function: ``"tpu"`` (Mosaic: BlockSpecs,
scalar prefetch, VMEM scratch) and ``"gpu"`` (Triton: a program walks its data with
``lax.fori_loop``). Each compiles only where its platform runs it natively and is interpreted
everywhere else (the CPU interprets both), so the kernels' tests run on any host.
"""

from __future__ import annotations

from typing import Literal

import jax
from jax.experimental.pallas import tpu as pltpu

try:  # the Triton dialect module; absent from some minimal jaxlib builds
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

Backend = Literal["tpu", "gpu"]

# Split-K's target on a GPU: about two programs per SM of an H100/H200 (132 SMs); the ragged
# kernel's GPU lowering sizes its splits by it.
GPU_TARGET_PROGRAMS = 264


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


def tpu_kv_heads_per_block(head_dim: int, kv_heads: int, interpret: bool) -> int:
    """KV heads per grid step. Heads are addressed as lane blocks of the free reshape
    [..., KVH*D]: one head per step when D fills whole 128-lane vregs, else Mosaic needs the
    block to span the whole last dim, so all KV heads go in one step (no HBM transpose or
    head_dim padding of q/k/v either way). Interpret mode has no such rule."""
    return 1 if interpret or head_dim % 128 == 0 else kv_heads
