"""The step batch: everything one jitted step reads, as one pytree, built in one place.

The scheduler's plan is host data (sequences, token ids, page ids). `build` turns its rows
into fixed-shape numpy arrays padded to a token bucket and a row bucket: one flat token array
(rows of any length one after another, vLLM v1's and tpu-inference's layout), positions, the
flat KV slot of every token, query_start_loc, seq_lens, block tables, the index of each row's
sampled token and the per-row sampling arrays (sampling controls, the grammar bitmask). The
ragged step, speculative verification, the warm-up and the kv-math timer all take a
`StepBatch` whole, so a new per-row input is one field here, not six signatures.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.sampling import ROW_CONTROLS
from pallas_kernels.reference import RaggedMetadata

DUMMY_PAGE = 0  # padding writes here and block tables are padded with it; never handed out
GREEDY = (0.0, 0, 1.0, 0, 0)  # a Chunk's sampling for a greedy row: (temperature, top_k, top_p, seed, counter)


# Fixed per-row list sizes of the sampling controls (the engine validates requests against them).
PENALTY_TOKENS = 256  # the most recent distinct tokens of a row the penalties see
MAX_LOGIT_BIAS = 64  # logit_bias entries of a row
MAX_STOP_IDS = 16  # EOS + stop token ids banned while a row is under its min_tokens
_CONTROL_COLUMN = {name: i for i, name in enumerate(ROW_CONTROLS)}
_CONTROL_DEFAULTS = np.array(list(ROW_CONTROLS.values()), np.float32)


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
    # [S, len(ROW_CONTROLS)] float32: the sampler's scalar controls (min_p, the penalties, ...),
    # a column each in ROW_CONTROLS' order, read by name (`sm.min_p`)
    row_controls: jax.Array
    min_tokens: jax.Array
    penalty_ids: jax.Array
    penalty_counts: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    stop_ids: jax.Array

    def __getattr__(self, name: str) -> jax.Array:
        """A scalar control's column [S] (only called for names that are not fields)."""
        if name in _CONTROL_COLUMN:
            return self.row_controls[:, _CONTROL_COLUMN[name]]
        raise AttributeError(name)

    @staticmethod
    def basics(num_rows: int) -> dict:
        """The per-row controls every sampling row sets (temperature, top_k, top_p, seed,
        counter), at their greedy defaults."""
        s = num_rows
        return dict(
            temperature=np.zeros((s,), np.float32),
            top_k=np.zeros((s,), np.int32),
            top_p=np.ones((s,), np.float32),
            seeds=np.zeros((s, 2), np.uint32),
            counters=np.zeros((s,), np.int32),
        )

    @classmethod
    def make(cls, num_rows: int, vocab_size: int, **given) -> "SamplingMetadata":
        """Every row at its defaults (greedy, no controls), with `given` fields replaced."""
        s, pad = num_rows, vocab_size
        f = dict(
            **cls.basics(s),
            row_controls=np.tile(_CONTROL_DEFAULTS, (s, 1)),
            min_tokens=np.zeros((s,), np.int32),
            penalty_ids=np.full((s, PENALTY_TOKENS), pad, np.int32),
            penalty_counts=np.zeros((s, PENALTY_TOKENS), np.int32),
            bias_ids=np.full((s, MAX_LOGIT_BIAS), pad, np.int32),
            bias_values=np.zeros((s, MAX_LOGIT_BIAS), np.float32),
            stop_ids=np.full((s, MAX_STOP_IDS), pad, np.int32),
        )
        for k, v in given.items():
            if k in _CONTROL_COLUMN:
                f["row_controls"][:, _CONTROL_COLUMN[k]] = np.asarray(v, np.float32).reshape(s)
            else:
                f[k] = np.asarray(v, f[k].dtype).reshape(f[k].shape)
        return cls(**f)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """One ragged step: N flat tokens (a token bucket) in R rows (a row bucket). Row r is one
    sequence's tokens this step, any number of them: a decode row has one, a prompt chunk many,
    a speculative row k + 1. Rows that sample (active) are sampled at their last token
    (`logits_indices`)."""

    tokens: jax.Array  # [N] int32
    attn: RaggedMetadata
    logits_indices: jax.Array  # [R] int32: the flat index of each row's last token
    active: jax.Array  # [R] bool: the row holds a sequence that samples this step
    sampling: SamplingMetadata
    num_drafts: jax.Array  # [R] int32: host-proposed draft tokens after a speculative row's first
    bitmask: jax.Array  # [R, ceil(V/32)] int32: bit t of a row = token t allowed (grammar); all ones otherwise
    # [N] int32: -1, or the row of the previous step whose sampled token this token takes
    # instead of tokens[n] (async scheduling: the host has not read that token yet)
    feed: jax.Array
    # A model with sliding-window layers: their pool's slots [N] and block tables [R, P] (the
    # dummy page where a page fell out of the window); None (no arrays) otherwise
    local_slots: jax.Array | None = None
    local_tables: jax.Array | None = None

    def layer_meta(self, metadata=lambda md: md):
        """What the model's layers read (`llama.layer_meta`): the step's RaggedMetadata through
        a backend's `metadata`, or with a local pool the pair (full layers', local layers')."""
        md = metadata(self.attn)
        if self.local_tables is None:
            return md
        local = dataclasses.replace(self.attn, slot_mapping=self.local_slots, block_tables=self.local_tables)
        return md, metadata(local)

    @property
    def positions(self) -> jax.Array:
        return self.attn.positions

    @property
    def num_rows(self) -> int:
        return self.logits_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def live_rows(self) -> jax.Array:
        """The real rows (traced int32): those with tokens, which come first; the rest pad the
        row bucket, and the vocabulary projection skips them (one decode or verify row in an
        8-row bucket would otherwise read the LM head for 8)."""
        return jnp.sum(jnp.diff(self.attn.query_start_loc) > 0).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Controls:
    """A row's sampling controls beyond (temperature, top_k, top_p, seed, counter): the scalar
    controls (`values`: one per ROW_CONTROLS entry, in its order; `values_of` makes them from a
    request's fields), min_tokens with the ids it bans, the penalties' recent tokens,
    logit_bias, and the grammar's packed bitmask row ([ceil(V/32)] int32; None: every token
    allowed)."""

    values: Sequence[float] = tuple(ROW_CONTROLS.values())
    min_tokens: int = 0
    stop_ids: Sequence[int] = ()
    penalty_ids: Sequence[int] = ()
    penalty_counts: Sequence[int] = ()
    bias_ids: Sequence[int] = ()
    bias_values: Sequence[float] = ()
    bitmask: np.ndarray | None = None

    @staticmethod
    def values_of(params) -> tuple[float, ...]:
        """The scalar controls of a request: its fields named as ROW_CONTROLS' entries."""
        return tuple(getattr(params, name) for name in ROW_CONTROLS)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Host input of one row of a step: one sequence's `tokens` at positions start.. through its
    block table `pages`. `sampling` (temperature, top_k, top_p, seed, counter) is set for rows
    that sample (at their last token), `controls` for rows with more; None: the row only
    fills KV. `num_drafts` counts the host-proposed drafts after tokens[0]."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    sampling: tuple[float, int, float, int, int] | None = None
    num_drafts: int = 0
    controls: Controls | None = None
    local_pages: Sequence[int] | None = None  # the sliding layers' block table (a local pool)


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


class BlockTables:
    """A row bucket's block tables [R, width], kept on the host between steps: a row is
    rewritten only when its sequence's pages changed (a decode row gains a page once every
    page_size tokens), not rebuilt from every row's page list each step."""

    def __init__(self, num_rows: int, width: int):
        self.width = width
        self._array = np.full((num_rows, width), DUMMY_PAGE, np.int32)
        self._rows: list[list[int]] = [[] for _ in range(num_rows)]  # each row's pages as written

    def update(self, pages_of: Sequence[Sequence[int]]) -> np.ndarray:
        """The tables of a step whose row r has pages_of[r] (rows past them: empty), as a new
        array: the device may still read the previous step's (on the CPU, jax can alias a
        large numpy input rather than copy it)."""
        arr, known, w = self._array, self._rows, self.width
        for r, pages in enumerate(pages_of):
            if known[r] != pages:
                n = min(w, len(pages))
                arr[r, :n] = pages[:n]
                arr[r, n:] = DUMMY_PAGE
                known[r] = list(pages)  # a copy: a sequence's list grows in place
        for r in range(len(pages_of), len(known)):
            if known[r]:
                arr[r] = DUMMY_PAGE
                known[r] = []
        return arr.copy()


@dataclasses.dataclass(frozen=True)
class Defaults:
    """A row bucket's inputs for steps where no row has controls or a grammar, made once and
    kept on the device: the all-ones bitmask ([R, V/32]: 4 MiB at 256 rows of a 128k
    vocabulary) and the no-op penalty, bias and stop lists are then neither built nor sent.
    With them, the bucket's block tables kept on the host (`BlockTables`, given its width)."""

    bitmask: jax.Array
    sampling: SamplingMetadata
    tables: BlockTables | None = None

    @classmethod
    def make(cls, num_rows: int, vocab_size: int, put=jnp.asarray, table_width: int = 0) -> "Defaults":
        bitmask = all_allowed(num_rows, vocab_size)
        tables = BlockTables(num_rows, table_width) if table_width else None
        return cls(put(bitmask), jax.tree.map(put, SamplingMetadata.make(num_rows, vocab_size)), tables)


def all_allowed(num_rows: int, vocab_size: int) -> np.ndarray:
    """The grammar bitmask [R, ceil(V/32)] of rows without a grammar: every token allowed."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, np.int32)


def build(
    rows: Sequence[Chunk],
    *,
    num_rows: int,
    num_tokens: int,
    table_width: int,
    page_size: int,
    vocab_size: int,
    row_len: int | None = None,
    feed: Sequence[int] = (),
    defaults: Defaults | None = None,
    local: bool = False,
) -> StepBatch:
    """The one place a step's device inputs are made: row i is rows[i], its tokens laid out
    one row after another in the flat token array. Rows past len(rows) are empty and tokens
    past the last row are padding: both write to the dummy page and see nothing. row_len:
    every row (padding too) spans exactly that many tokens (speculative steps, which the
    verifier reshapes to [R, k + 1]). feed[i] >= 0: row i's first token is the previous step's
    sampled token of row feed[i], read on the device. defaults (for num_rows): used where no
    row has controls or a grammar, and its block tables kept between steps. local: the model
    has a local pool; rows' `local_pages` (None: the dummy page) make the local slots and block
    tables.

    A step of plain decode rows only (one token each, sampling, no controls) without a local
    pool, the steady state of serving, is laid out column by column (`_decode_batch`); any
    other step row by row."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows exceed the row bucket {num_rows}")
    kept = defaults.tables if defaults is not None else None
    table = _block_tables([c.pages for c in rows], num_rows, table_width, kept)
    if (
        row_len is None
        and not local
        and defaults is not None
        and len(rows) <= num_tokens
        and all(len(c.tokens) == 1 and c.sampling is not None and c.controls is None for c in rows)
    ):
        return _decode_batch(rows, num_rows, num_tokens, table, page_size, feed, defaults)
    return _row_batch(rows, num_rows, num_tokens, table, page_size, vocab_size, row_len, feed, defaults, local)


def _block_tables(pages_of: Sequence[Sequence[int]], num_rows: int, width: int, kept: BlockTables | None) -> np.ndarray:
    """The step's block tables [num_rows, width]: from the bucket's kept tables where it has
    them (of this width), else made afresh (rows past pages_of: the dummy page)."""
    if kept is not None and kept.width == width:
        return kept.update(pages_of)
    table = np.full((num_rows, width), DUMMY_PAGE, np.int32)
    for r, pages in enumerate(pages_of):
        n = min(width, len(pages))
        table[r, :n] = pages[:n]
    return table


def _decode_batch(
    rows: Sequence[Chunk],
    num_rows: int,
    num_tokens: int,
    table: np.ndarray,
    page_size: int,
    feed: Sequence[int],
    defaults: Defaults,
) -> StepBatch:
    """`build` of plain decode rows: each input made from one list over the rows (no numpy call
    per row) beside the step's block tables (`_block_tables`), the controls and bitmask the
    bucket's no-op ones already on the device. Row r is flat token r."""
    n, table_width = len(rows), table.shape[1]
    pages_of = [c.pages for c in rows]
    starts = np.array([c.start for c in rows], np.int64)
    tokens = np.zeros((num_tokens,), np.int32)
    tokens[:n] = [c.tokens[0] for c in rows]
    positions = np.zeros((num_tokens,), np.int32)
    positions[:n] = starts
    # a position past the row's pages writes to the dummy page (slot_mapping's rule)
    index = starts // page_size
    held = np.array([len(p) for p in pages_of], np.int64)
    page = table[np.arange(n), np.minimum(index, table_width - 1)] if n else np.zeros((0,), np.int32)
    slots = np.full((num_tokens,), DUMMY_PAGE * page_size, np.int32)
    slots[:n] = np.where(index < held, page.astype(np.int64) * page_size + starts % page_size, DUMMY_PAGE * page_size)
    seq_lens = np.zeros((num_rows,), np.int32)
    seq_lens[:n] = starts + 1
    qsl = np.full((num_rows + 1,), n, np.int32)
    qsl[: n + 1] = np.arange(n + 1)
    logits_indices = np.zeros((num_rows,), np.int32)
    logits_indices[:n] = qsl[:n]
    active = np.zeros((num_rows,), bool)
    active[:n] = True
    fed = np.full((num_tokens,), -1, np.int32)
    m = min(len(feed), n)
    fed[:m] = feed[:m]
    basics = SamplingMetadata.basics(num_rows)
    if n:
        t, k, p, seed, counter = zip(*[c.sampling for c in rows])
        basics["temperature"][:n], basics["top_k"][:n], basics["top_p"][:n] = t, k, p
        basics["counters"][:n] = counter
        seeds = np.array(seed, np.uint64)
        basics["seeds"][:n, 0], basics["seeds"][:n, 1] = seeds & 0xFFFFFFFF, seeds >> 32
    return StepBatch(
        tokens,
        RaggedMetadata(slots, table, seq_lens, qsl, positions),
        logits_indices,
        active,
        dataclasses.replace(defaults.sampling, **basics),
        np.zeros((num_rows,), np.int32),
        defaults.bitmask,
        fed,
    )


def _row_batch(
    rows: Sequence[Chunk],
    num_rows: int,
    num_tokens: int,
    tables: np.ndarray,
    page_size: int,
    vocab_size: int,
    row_len: int | None,
    feed: Sequence[int],
    defaults: Defaults | None,
    local: bool,
) -> StepBatch:
    """`build` of any rows (prompt chunks, speculative rows, controls), row by row, given the
    step's block tables. The grammar bitmask [R, V/32] is built only when a row has one."""
    tokens = np.zeros((num_tokens,), np.int32)
    positions = np.zeros((num_tokens,), np.int32)
    slots = np.full((num_tokens,), DUMMY_PAGE * page_size, np.int32)
    seq_lens = np.zeros((num_rows,), np.int32)
    qsl = np.zeros((num_rows + 1,), np.int32)
    logits_indices = np.zeros((num_rows,), np.int32)
    active = np.zeros((num_rows,), bool)
    plain = defaults is not None and all(c.controls is None for c in rows)
    if plain:  # only the per-row basics are made here
        sm = dataclasses.replace(defaults.sampling, **SamplingMetadata.basics(num_rows))
    else:
        sm = SamplingMetadata.make(num_rows, vocab_size)
    masked = any(c.controls is not None and c.controls.bitmask is not None for c in rows)
    bitmask = defaults.bitmask if defaults is not None and not masked else all_allowed(num_rows, vocab_size)
    num_drafts = np.zeros((num_rows,), np.int32)
    fed = np.full((num_tokens,), -1, np.int32)
    table_width = tables.shape[1]
    if local:
        local_slots = np.full((num_tokens,), DUMMY_PAGE * page_size, np.int32)
        local_tables = np.full((num_rows, table_width), DUMMY_PAGE, np.int32)
    off = 0
    for r, c in enumerate(rows):
        m = len(c.tokens)
        if row_len is not None:
            if m != row_len:
                raise ValueError(f"row {r}: {m} tokens, every row of this step has {row_len}")
            off = r * row_len
        if off + m > num_tokens:
            raise ValueError(f"row {r}: {off + m} tokens exceed the bucket of {num_tokens}")
        if m == 1:  # a decode row: scalars, no per-row numpy calls
            p, i = c.start, c.start // page_size
            tokens[off] = c.tokens[0]
            positions[off] = p
            slots[off] = c.pages[i] * page_size + p % page_size if i < len(c.pages) else DUMMY_PAGE * page_size
        else:
            pos = np.arange(c.start, c.start + m)
            tokens[off : off + m] = c.tokens
            positions[off : off + m] = pos
            slots[off : off + m] = slot_mapping(c.pages, pos, page_size)
        if local and c.local_pages:
            lp = c.local_pages
            local_slots[off : off + m] = slot_mapping(lp, positions[off : off + m], page_size)
            local_tables[r, : min(table_width, len(lp))] = lp[:table_width]
        if r < len(feed) and feed[r] >= 0:
            fed[off] = feed[r]
        seq_lens[r] = c.start + m
        qsl[r] = off
        off += m
        qsl[r + 1] = off
        logits_indices[r] = off - 1
        num_drafts[r] = c.num_drafts
        if c.sampling is not None:
            active[r] = True
            t, k, p, seed, counter = c.sampling
            sm.temperature[r], sm.top_k[r], sm.top_p[r], sm.counters[r] = t, k, p, counter
            sm.seeds[r] = (seed & 0xFFFFFFFF, seed >> 32)
        if c.controls is not None:
            _fill_controls(r, c.controls, sm, bitmask)
    for r in range(len(rows), num_rows):  # padding rows: empty (uniform rows: row_len padding tokens each)
        qsl[r + 1] = (r + 1) * row_len if row_len is not None else off
        qsl[r] = qsl[r + 1] - (row_len or 0)
    return StepBatch(
        tokens,
        RaggedMetadata(slots, tables, seq_lens, qsl, positions),
        logits_indices,
        active,
        sm,
        num_drafts,
        bitmask,
        fed,
        *((local_slots, local_tables) if local else ()),
    )


def _fill_controls(r: int, ctl: Controls, sm: SamplingMetadata, bitmask) -> None:
    """Row r's sampling controls (and grammar bitmask row) into the step's arrays."""
    sm.row_controls[r], sm.min_tokens[r] = ctl.values, ctl.min_tokens
    _fill(r, sm.penalty_ids, ctl.penalty_ids, sm.penalty_counts, ctl.penalty_counts)
    _fill(r, sm.bias_ids, ctl.bias_ids, sm.bias_values, ctl.bias_values)
    _fill(r, sm.stop_ids, ctl.stop_ids)
    if ctl.bitmask is not None:
        bitmask[r] = ctl.bitmask
