"""Attention backends: one interface the model calls, one implementation per kernel family.

Every step (the ragged step, speculative verification, the draft's proposals) hands the
model one `RaggedMetadata` (flat tokens, query_start_loc, seq_lens, block tables, slot mapping).
A backend turns it into what its kernel wants once per step (`metadata`, inside the jitted
step, outside the layer loop) and runs `forward(q, k, v, kv_cache, md, scale=...)` in every
layer. Nothing branches on a step kind: a decode row, a prompt chunk and a verification row
are rows of different lengths. A new attention variant is a new backend here and its kernel
in `pallas_kernels/`; the model, the runner and the engine do not change.

| backend | kernel | where |
|---|---|---|
| `native` | `native.ragged_paged_attention`: C++ through XLA FFI | the CPU default |
| `pallas` | `ragged_paged_attention.ragged_paged_attention`: Mosaic (TPU) or Triton (GPU) lowering | TPU / GPU default |
| `xla` | `reference.ragged_paged_attention_chunked`: a jnp online-softmax loop over pages | anywhere; fp8 pages on the CPU |
| `cudnn` | fresh prompts: `prompt_attention.dense` (cuDNN's fused attention); the rest: `pallas` | GPU, bf16/fp16 (CPU: XLA stands in) |
| `tokamax` | the same with tokamax's flash attention (Mosaic GPU, else Triton) for fresh prompts | GPU with PyPI tokamax installed |

Every kernel takes the oracle's arguments (`reference.ragged_paged_attention`), so one adapter
(`paged_forward`) turns any of them into a backend's forward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp

from pallas_kernels import prompt_attention, reference
from pallas_kernels.reference import RaggedMetadata


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """`forward(q, k, v, kv_cache, md, *, scale, window=None)`: q [..., H, D] (leading axes
    flatten to the step's N tokens), k/v this step's new keys and values (already in `kv_cache`,
    the layer's cache tuple), md what `metadata` built, window the layer's sliding window (each
    token sees its last `window` positions; None: all of them). Returns q's shape."""

    name: str
    forward: Callable[..., Any]
    metadata: Callable[[RaggedMetadata], Any] = lambda md: md  # noqa: E731

    def wrap(self, fn: Callable[[Callable], Callable]) -> "AttentionBackend":
        """The same backend with `forward` wrapped (tensor parallelism's per-chip shard_map)."""
        return dataclasses.replace(self, forward=fn(self.forward))


def paged_forward(kernel: Callable) -> Callable:
    """A backend's forward from a ragged paged-attention kernel with the oracle's arguments
    (`reference.ragged_paged_attention`: q [N, H, D], pages, query_start_loc, seq_lens,
    block_tables, positions, scale, k_scales, v_scales, *, sliding_window): q's leading axes
    flattened to the step's tokens, the layer's cache tuple split into pages and scales (this
    step's k/v are already in the pages, so k and v themselves are not read). A layer without a
    window calls the kernel exactly as before windows existed."""

    def forward(q, k, v, kv_cache, md, *, scale, window=None):
        del k, v
        k_pages, v_pages, k_scales, v_scales = reference.split_cache(kv_cache)
        offset = reference.page_offset(kv_cache)  # a layer of a stacked pool: its pages' place
        out = kernel(
            q.reshape(-1, *q.shape[-2:]),
            k_pages,
            v_pages,
            md.query_start_loc,
            md.seq_lens,
            md.block_tables + offset if offset else md.block_tables,
            md.positions,
            scale,
            k_scales,
            v_scales,
            **({"sliding_window": window} if window else {}),
        )
        return out.reshape(q.shape)

    return forward


def _native_kernel(*args, **kw):
    from pallas_kernels import native

    return native.ragged_paged_attention(*args, **kw)


def _pallas_kernel(*args, interpret: bool, **kw):
    """kw: a sliding layer's `sliding_window`."""
    from pallas_kernels import ragged_paged_attention as rpa

    return rpa.ragged_paged_attention(*args, interpret=interpret, **kw)


def prompt_split(name: str, kernel: Callable, implementation: str) -> AttentionBackend:
    """A backend that runs fresh prompts (rows with no cached prefix) through a dense fused
    attention over the step's own k/v (`prompt_attention.dense` with `implementation`: "cudnn"
    or "xla") and every other row through the paged `kernel` (the oracle's arguments), in the
    same step. Where `implementation` cannot take q (cuDNN: float32, odd head dims; a static
    choice) every row goes to the paged kernel."""
    paged = paged_forward(kernel)

    def forward(q, k, v, kv_cache, plan, *, scale, window=None):
        kw = {"window": window} if window else {}
        flat = q.reshape(-1, *q.shape[-2:])
        if not prompt_attention.supported(flat, implementation):
            return paged(q, k, v, kv_cache, plan.md, scale=scale, **kw)
        rest = paged(q, k, v, kv_cache, plan.paged(), scale=scale, **kw).reshape(flat.shape)
        kv_shape = (-1, *k.shape[-2:])
        fresh = prompt_attention.dense(
            flat,
            k.reshape(kv_shape),
            v.reshape(kv_shape),
            plan,
            scale=scale,
            implementation=implementation,
            window=window,
        )
        out = jnp.where(prompt_attention.fresh_tokens(plan)[:, None, None], fresh.astype(rest.dtype), rest)
        return out.reshape(q.shape)

    return AttentionBackend(name, forward, metadata=prompt_attention.split)


# The prompt-split backends: attention_impl -> prompt_attention's implementation (compiled,
# interpreted: the CPU's stand-in). "tokamax" needs PyPI tokamax (optional).
PROMPT_IMPLS = {"cudnn": ("cudnn", "xla"), "tokamax": ("tokamax", "tokamax-xla")}
IMPLS = ("native", "pallas", "xla", *PROMPT_IMPLS)
# backends whose kernels are custom calls: under a mesh they run per chip (shard_attention)
CUSTOM_CALL_IMPLS = ("native", "pallas", *PROMPT_IMPLS)


def make(impl: str, interpret: bool = False) -> AttentionBackend:
    """The backend named by `attention_impl` (one of IMPLS). `interpret` runs the device kernels
    on the CPU: Pallas interpreted and, for "cudnn", XLA's dense attention in cuDNN's place."""
    if impl == "native":
        return AttentionBackend("native", paged_forward(_native_kernel))
    if impl == "pallas":
        return AttentionBackend("pallas", paged_forward(functools.partial(_pallas_kernel, interpret=interpret)))
    if impl == "xla":
        return AttentionBackend("xla", paged_forward(reference.ragged_paged_attention_chunked))
    if impl in PROMPT_IMPLS:
        kernel = functools.partial(_pallas_kernel, interpret=interpret)
        return prompt_split(impl, kernel, PROMPT_IMPLS[impl][1 if interpret else 0])
    raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
