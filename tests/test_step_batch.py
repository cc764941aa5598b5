"""step_batch.build: the device inputs of a step, against a plain NumPy recomputation."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runner.step_batch import DUMMY_PAGE, Chunk, build, slot_mapping

PS = 4


@st.composite
def _rows(draw):
    """Rows of one or more chunks: decode rows (one token), continuation and packed prompt rows,
    some with positions past their block table (those write to the dummy page)."""
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        chunks = []
        for _ in range(draw(st.integers(1, 3))):
            pages = draw(st.lists(st.integers(1, 50), min_size=0, max_size=5))
            start = draw(st.integers(0, 4 * PS * 2))
            tokens = draw(st.lists(st.integers(0, 99), min_size=1, max_size=4))
            chunks.append(Chunk(tokens, start, pages, (0.5, 3, 0.9, 7, start)))
        rows.append(chunks)
    return rows


@settings(max_examples=200, deadline=None)
@given(rows=_rows())
def test_build_places_every_token(rows):
    num_tokens = max(sum(len(c.tokens) for c in chunks) for chunks in rows) + 1
    b = build(rows, num_rows=len(rows) + 1, num_tokens=num_tokens, table_width=3, page_size=PS, vocab_size=64)
    meta = b.attn
    dummy = DUMMY_PAGE * PS
    for r, chunks in enumerate(rows):
        off = 0
        for seg, c in enumerate(chunks):
            for j, tok in enumerate(c.tokens):
                p = c.start + j
                i = p // PS
                want_slot = c.pages[i] * PS + p % PS if i < len(c.pages) else dummy
                assert (b.tokens[r, off], meta.positions[r, off], meta.segment_ids[r, off]) == (tok, p, seg)
                assert meta.slot_mapping[r, off] == want_slot
                off += 1
        assert np.all(meta.slot_mapping[r, off:] == dummy) and np.all(meta.segment_ids[r, off:] == -1)
        first = chunks[0]
        table = list(first.pages[:3]) + [DUMMY_PAGE] * (3 - min(3, len(first.pages)))
        assert meta.block_tables[r].tolist() == table
        assert meta.context_lens[r] == first.start + len(first.tokens) and b.active[r]
    assert not b.active[len(rows)] and np.all(meta.slot_mapping[len(rows)] == dummy)


def test_decode_rows_match_slot_mapping():
    """The one-token (decode) rows are built without per-row numpy calls; their slots are
    slot_mapping's, inside the table and past it."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        pages = rng.integers(1, 100, rng.integers(0, 6)).tolist()
        rows.append([Chunk([int(rng.integers(0, 50))], int(rng.integers(0, 7 * PS)), pages)])
    b = build(rows, num_rows=40, num_tokens=1, table_width=5, page_size=PS, vocab_size=64)
    for r, (c,) in enumerate(rows):
        want = slot_mapping(c.pages, np.array([c.start]), PS)[0]
        assert b.attn.slot_mapping[r, 0] == want
