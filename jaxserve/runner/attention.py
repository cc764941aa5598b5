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

Every kernel takes the oracle's arguments (`reference.ragged_paged_attention`), so one adapter
(`paged_forward`) turns any of them into a backend's forward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from pallas_kernels import reference
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


def make(impl: str, interpret: bool = False) -> AttentionBackend:
    """The backend named by `attention_impl` ("native" | "pallas" | "xla")."""
    if impl == "native":
        return AttentionBackend("native", paged_forward(_native_kernel))
    if impl == "pallas":
        return AttentionBackend("pallas", paged_forward(functools.partial(_pallas_kernel, interpret=interpret)))
    if impl == "xla":
        return AttentionBackend("xla", paged_forward(reference.ragged_paged_attention_chunked))
    raise ValueError(f"attention_impl must be 'native', 'pallas' or 'xla', got {impl!r}")
