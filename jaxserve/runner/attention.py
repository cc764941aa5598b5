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
| `native` | C++ ragged paged attention through XLA FFI (`pallas_kernels/native.py`) | the CPU default |
| `pallas` | Pallas ragged paged attention, Mosaic (TPU) or Triton (GPU) lowering | TPU / GPU default |
| `xla` | `reference.ragged_attention`: a jnp online-softmax loop over pages | anywhere; fp8 pages on the CPU |
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from pallas_kernels import reference
from pallas_kernels.reference import RaggedMetadata


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """`forward(q, k, v, kv_cache, md, *, scale)`: q [..., H, D] (leading axes flatten to the
    step's N tokens), k/v this step's new keys and values (already in `kv_cache`, the layer's
    cache tuple), md what `metadata` built. Returns q's shape."""

    name: str
    forward: Callable[..., Any]
    metadata: Callable[[RaggedMetadata], Any] = lambda md: md  # noqa: E731

    def wrap(self, fn: Callable[[Callable], Callable]) -> "AttentionBackend":
        """The same backend with `forward` wrapped (tensor parallelism's per-chip shard_map)."""
        return dataclasses.replace(self, forward=fn(self.forward))


def _native_forward(q, k, v, kv_cache, md, *, scale):
    from pallas_kernels import native

    shape = q.shape
    out = native.ragged_attention(q.reshape(-1, *shape[-2:]), k, v, kv_cache, md, scale=scale)
    return out.reshape(shape)


def _pallas_forward(q, k, v, kv_cache, md, *, scale, interpret: bool):
    from pallas_kernels import ragged_paged_attention as rpa

    shape = q.shape
    out = rpa.attention(q.reshape(-1, *shape[-2:]), k, v, kv_cache, md, scale=scale, interpret=interpret)
    return out.reshape(shape)


def make(impl: str, interpret: bool = False) -> AttentionBackend:
    """The backend named by `attention_impl` ("native" | "pallas" | "xla")."""
    if impl == "native":
        return AttentionBackend("native", _native_forward)
    if impl == "pallas":
        return AttentionBackend("pallas", functools.partial(_pallas_forward, interpret=interpret))
    if impl == "xla":
        return AttentionBackend("xla", reference.ragged_attention)
    raise ValueError(f"attention_impl must be 'native', 'pallas' or 'xla', got {impl!r}")
