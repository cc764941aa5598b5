"""The step batch: everything one jitted step reads, as one pytree, built in one place.

The scheduler's plan is host data (sequences, token ids, page ids). `build` turns rows of it
into fixed-shape numpy arrays padded to a bucket: tokens, positions, the flat KV slot of
every new token, block tables, context lengths, segment ids and the per-row sampling
arrays. Every jitted step (prefill, decode, speculative verify), the warm-up and the
kv-math timer take a `StepBatch` whole, so a new per-row input (a grammar bitmask, a
quantization scale) is one field here, not six signatures.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from pallas_kernels.reference import AttentionMetadata

DUMMY_PAGE = 0  # padding writes here and block tables are padded with it; never handed out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling controls [S]; seeds uint32 [S, 2] and counters (tokens generated so
    far) make each row's random key, so a draw never depends on the batch."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counters: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    tokens: jax.Array  # [S, T] int32
    attn: AttentionMetadata
    active: jax.Array  # [S] bool: the row holds a sequence
    sampling: SamplingMetadata
    num_drafts: jax.Array  # [S] int32: host-proposed draft tokens in tokens[:, 1:] (speculative steps)

    @property
    def positions(self) -> jax.Array:
        return self.attn.positions

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Host input of one sequence in a step: feed `tokens` at positions start.. through the
    sequence's block table `pages`. `sampling` (temperature, top_k, top_p, seed, counter) is
    set for rows that sample; `num_drafts` counts the host-proposed drafts after tokens[0]."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    sampling: tuple[float, int, float, int, int] | None = None
    num_drafts: int = 0


def slot_mapping(pages: Sequence[int], positions: np.ndarray, page_size: int) -> np.ndarray:
    """Flat KV slots (page * page_size + offset) of `positions` through one block table;
    positions past the table go to the dummy page."""
    table = np.asarray(pages, np.int64)
    idx = positions // page_size
    ok = idx < len(table)
    page = table[np.where(ok, idx, 0)] if len(table) else np.zeros_like(idx)
    return np.where(ok, page * page_size + positions % page_size, DUMMY_PAGE * page_size).astype(np.int32)


def build(
    rows: Sequence[Sequence[Chunk]], *, num_rows: int, num_tokens: int, table_width: int, page_size: int
) -> StepBatch:
    """The one place a step's device inputs are made. Each row packs one or more chunks, each
    its own segment (fresh prompts share a row; decode and continuation rows hold one);
    rows past len(rows) and tokens past a row's chunks are padding that writes to the dummy
    page. A row's block table is its first chunk's pages (cut to table_width), its context
    length that chunk's start + length."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows exceed the batch bucket {num_rows}")
    tokens = np.zeros((num_rows, num_tokens), np.int32)
    positions = np.zeros((num_rows, num_tokens), np.int32)
    slots = np.full((num_rows, num_tokens), DUMMY_PAGE * page_size, np.int32)
    segments = np.full((num_rows, num_tokens), -1, np.int32)
    tables = np.full((num_rows, table_width), DUMMY_PAGE, np.int32)
    context = np.zeros((num_rows,), np.int32)
    active = np.zeros((num_rows,), bool)
    temperature = np.zeros((num_rows,), np.float32)
    top_k = np.zeros((num_rows,), np.int32)
    top_p = np.ones((num_rows,), np.float32)
    seeds = np.zeros((num_rows, 2), np.uint32)
    counters = np.zeros((num_rows,), np.int32)
    num_drafts = np.zeros((num_rows,), np.int32)
    for r, chunks in enumerate(rows):
        off = 0
        for seg, c in enumerate(chunks):
            m = len(c.tokens)
            if off + m > num_tokens:
                raise ValueError(f"row {r}: {off + m} tokens exceed the bucket of {num_tokens}")
            pos = np.arange(c.start, c.start + m)
            tokens[r, off : off + m] = c.tokens
            positions[r, off : off + m] = pos
            slots[r, off : off + m] = slot_mapping(c.pages, pos, page_size)
            segments[r, off : off + m] = seg
            off += m
        first = chunks[0]
        n = min(table_width, len(first.pages))
        tables[r, :n] = first.pages[:n]
        context[r] = first.start + len(first.tokens)
        active[r] = True
        num_drafts[r] = first.num_drafts
        if first.sampling is not None:
            t, k, p, seed, counter = first.sampling
            temperature[r], top_k[r], top_p[r], counters[r] = t, k, p, counter
            seeds[r] = (seed & 0xFFFFFFFF, seed >> 32)
    return StepBatch(
        tokens,
        AttentionMetadata(slots, tables, context, positions, segments),
        active,
        SamplingMetadata(temperature, top_k, top_p, seeds, counters),
        num_drafts,
    )
