"""The step batch: everything one jitted step reads, as one pytree, built in one place.

The scheduler's plan is host data (sequences, token ids, page ids). `build` turns rows of it
into fixed-shape numpy arrays padded to a bucket: tokens, positions, the flat KV slot of
every new token, block tables, context lengths, segment ids and the per-row sampling
arrays (sampling controls, the grammar bitmask). Every jitted step (prefill, decode, speculative verify), the warm-up and the
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


# Fixed per-row list sizes of the sampling controls (the engine validates requests against them).
PENALTY_TOKENS = 256  # the most recent distinct tokens of a row the penalties see
MAX_LOGIT_BIAS = 64  # logit_bias entries of a row
MAX_STOP_IDS = 16  # EOS + stop token ids banned while a row is under its min_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling controls [S]; seeds uint32 [S, 2] and counters (tokens generated so
    far) make each row's random key, so a draw never depends on the batch. Token lists are
    padded with the vocabulary size (an id the device drops): penalty_ids/penalty_counts
    [S, PENALTY_TOKENS] (a row's recent distinct tokens and their counts in its output),
    bias_ids/bias_values [S, MAX_LOGIT_BIAS], stop_ids [S, MAX_STOP_IDS] (banned while
    counters < min_tokens). Defaults (1.0, 0.0, padding) are exact no-ops."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    min_tokens: jax.Array
    penalty_ids: jax.Array
    penalty_counts: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    stop_ids: jax.Array

    @classmethod
    def make(cls, num_rows: int, vocab_size: int, **given) -> "SamplingMetadata":
        """Every row at its defaults (greedy, no controls), with `given` fields replaced."""
        s, pad = num_rows, vocab_size
        f = dict(
            temperature=np.zeros((s,), np.float32),
            top_k=np.zeros((s,), np.int32),
            top_p=np.ones((s,), np.float32),
            seeds=np.zeros((s, 2), np.uint32),
            counters=np.zeros((s,), np.int32),
            min_p=np.zeros((s,), np.float32),
            repetition_penalty=np.ones((s,), np.float32),
            presence_penalty=np.zeros((s,), np.float32),
            frequency_penalty=np.zeros((s,), np.float32),
            min_tokens=np.zeros((s,), np.int32),
            penalty_ids=np.full((s, PENALTY_TOKENS), pad, np.int32),
            penalty_counts=np.zeros((s, PENALTY_TOKENS), np.int32),
            bias_ids=np.full((s, MAX_LOGIT_BIAS), pad, np.int32),
            bias_values=np.zeros((s, MAX_LOGIT_BIAS), np.float32),
            stop_ids=np.full((s, MAX_STOP_IDS), pad, np.int32),
        )
        for k, v in given.items():
            f[k] = np.asarray(v, f[k].dtype).reshape(f[k].shape)
        return cls(**f)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    tokens: jax.Array  # [S, T] int32
    attn: AttentionMetadata
    active: jax.Array  # [S] bool: the row holds a sequence
    sampling: SamplingMetadata
    num_drafts: jax.Array  # [S] int32: host-proposed draft tokens in tokens[:, 1:] (speculative steps)
    bitmask: jax.Array  # [S, ceil(V/32)] int32: bit t of a row = token t allowed (grammar); all ones otherwise
    # [S] int32: -1, or the row of the previous decode step whose sampled token this row
    # feeds instead of tokens[:, 0] (async scheduling: the host has not read that token yet)
    feed: jax.Array

    @property
    def positions(self) -> jax.Array:
        return self.attn.positions

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


@dataclasses.dataclass(frozen=True)
class Controls:
    """A row's sampling controls beyond (temperature, top_k, top_p, seed, counter): penalties,
    min_p, min_tokens with the ids it bans, logit_bias, and the grammar's packed bitmask row
    ([ceil(V/32)] int32; None: every token allowed)."""

    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_ids: Sequence[int] = ()
    penalty_ids: Sequence[int] = ()
    penalty_counts: Sequence[int] = ()
    bias_ids: Sequence[int] = ()
    bias_values: Sequence[float] = ()
    bitmask: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Host input of one sequence in a step: feed `tokens` at positions start.. through the
    sequence's block table `pages`. `sampling` (temperature, top_k, top_p, seed, counter) is
    set for rows that sample, `controls` for rows with more; `num_drafts` counts the
    host-proposed drafts after tokens[0]."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    sampling: tuple[float, int, float, int, int] | None = None
    num_drafts: int = 0
    controls: Controls | None = None


def slot_mapping(pages: Sequence[int], positions: np.ndarray, page_size: int) -> np.ndarray:
    """Flat KV slots (page * page_size + offset) of `positions` through one block table;
    positions past the table go to the dummy page."""
    table = np.asarray(pages, np.int64)
    idx = positions // page_size
    ok = idx < len(table)
    page = table[np.where(ok, idx, 0)] if len(table) else np.zeros_like(idx)
    return np.where(ok, page * page_size + positions % page_size, DUMMY_PAGE * page_size).astype(np.int32)


def _fill(r: int, ids: np.ndarray, row_ids, values: np.ndarray | None = None, row_values=()) -> None:
    """Row r of a padded id list (and its values) from a row's own list."""
    n = len(row_ids)
    if n > ids.shape[1]:
        raise ValueError(f"row {r}: {n} token ids exceed the fixed list of {ids.shape[1]}")
    ids[r, :n] = row_ids
    if values is not None:
        values[r, :n] = row_values


def build(
    rows: Sequence[Sequence[Chunk]],
    *,
    num_rows: int,
    num_tokens: int,
    table_width: int,
    page_size: int,
    vocab_size: int,
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
    sm = SamplingMetadata.make(num_rows, vocab_size)
    bitmask = np.full((num_rows, (vocab_size + 31) // 32), -1, np.int32)
    num_drafts = np.zeros((num_rows,), np.int32)
    feed = np.full((num_rows,), -1, np.int32)
    for r, chunks in enumerate(rows):
        off = 0
        for seg, c in enumerate(chunks):
            m = len(c.tokens)
            if off + m > num_tokens:
                raise ValueError(f"row {r}: {off + m} tokens exceed the bucket of {num_tokens}")
            if m == 1:  # a decode row, the common case: scalars, no per-row numpy calls
                p, i = c.start, c.start // page_size
                tokens[r, off] = c.tokens[0]
                positions[r, off] = p
                slots[r, off] = c.pages[i] * page_size + p % page_size if i < len(c.pages) else DUMMY_PAGE * page_size
                segments[r, off] = seg
            else:
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
            sm.temperature[r], sm.top_k[r], sm.top_p[r], sm.counters[r] = t, k, p, counter
            sm.seeds[r] = (seed & 0xFFFFFFFF, seed >> 32)
        ctl = first.controls
        if ctl is not None:
            sm.min_p[r], sm.min_tokens[r] = ctl.min_p, ctl.min_tokens
            sm.repetition_penalty[r], sm.presence_penalty[r] = ctl.repetition_penalty, ctl.presence_penalty
            sm.frequency_penalty[r] = ctl.frequency_penalty
            _fill(r, sm.penalty_ids, ctl.penalty_ids, sm.penalty_counts, ctl.penalty_counts)
            _fill(r, sm.bias_ids, ctl.bias_ids, sm.bias_values, ctl.bias_values)
            _fill(r, sm.stop_ids, ctl.stop_ids)
            if ctl.bitmask is not None:
                bitmask[r] = ctl.bitmask
    return StepBatch(
        tokens, AttentionMetadata(slots, tables, context, positions, segments), active, sm, num_drafts, bitmask, feed
    )
