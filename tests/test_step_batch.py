"""step_batch.build: the device inputs of a ragged step, against a plain NumPy recomputation."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runner.step_batch import DUMMY_PAGE, Chunk, Defaults, build, slot_mapping

pytestmark = pytest.mark.fast

PS = 4


@st.composite
def _rows(draw):
    """Rows of any length (decode rows of one token, prompt chunks), sampling or not, some with
    positions past their block table (those write to the dummy page)."""
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        pages = draw(st.lists(st.integers(1, 50), min_size=0, max_size=5))
        start = draw(st.integers(0, 4 * PS * 2))
        tokens = draw(st.lists(st.integers(0, 99), min_size=1, max_size=6))
        sampling = (0.5, 3, 0.9, 7, start) if draw(st.booleans()) else None
        rows.append(Chunk(tokens, start, pages, sampling))
    return rows


@settings(max_examples=200, deadline=None)
@given(rows=_rows(), extra=st.integers(0, 5))
def test_build_places_every_token(rows, extra):
    num_tokens = sum(len(c.tokens) for c in rows) + extra
    feed = [i - 1 for i in range(len(rows))]  # row 0 not fed, row i from the previous step's row i - 1
    b = build(
        rows, num_rows=len(rows) + 1, num_tokens=num_tokens, table_width=3, page_size=PS, vocab_size=64, feed=feed
    )
    meta = b.attn
    dummy = DUMMY_PAGE * PS
    off = 0
    for r, c in enumerate(rows):
        assert meta.query_start_loc[r] == off
        for j, tok in enumerate(c.tokens):
            p = c.start + j
            i = p // PS
            want_slot = c.pages[i] * PS + p % PS if i < len(c.pages) else dummy
            assert (b.tokens[off + j], meta.positions[off + j], meta.slot_mapping[off + j]) == (tok, p, want_slot)
            assert b.feed[off + j] == (feed[r] if j == 0 else -1)
        off += len(c.tokens)
        assert meta.query_start_loc[r + 1] == off and b.logits_indices[r] == off - 1
        table = list(c.pages[:3]) + [DUMMY_PAGE] * (3 - min(3, len(c.pages)))
        assert meta.block_tables[r].tolist() == table
        assert meta.seq_lens[r] == c.start + len(c.tokens)
        assert b.active[r] == (c.sampling is not None)
    # padding: an empty row past the last, tokens past the rows write to the dummy page
    assert meta.query_start_loc[-1] == off and meta.seq_lens[len(rows)] == 0 and not b.active[len(rows)]
    assert np.all(meta.slot_mapping[off:] == dummy) and np.all(b.feed[off:] == -1)
    # the rows the vocabulary projection multiplies: the real ones, not the bucket's padding row
    assert int(b.live_rows()) == len(rows)


def test_uniform_rows_for_speculative_steps():
    """row_len: every row, padding rows too, spans k + 1 tokens, so the verifier can reshape."""
    rows = [Chunk([5, 6, 7], 10, [3, 4, 5, 6], (0.0, 0, 1.0, 1, 0)), Chunk([8, 9, 1], 4, [7, 8], (0.0, 0, 1.0, 1, 0))]
    b = build(rows, num_rows=4, num_tokens=12, table_width=4, page_size=PS, vocab_size=64, row_len=3)
    assert b.attn.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert b.tokens.reshape(4, 3)[:2].tolist() == [[5, 6, 7], [8, 9, 1]]
    assert b.attn.seq_lens.tolist() == [13, 7, 0, 0]


def test_decode_rows_match_slot_mapping():
    """The one-token (decode) rows are built without per-row numpy calls; their slots are
    slot_mapping's, inside the table and past it."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        pages = rng.integers(1, 100, rng.integers(0, 6)).tolist()
        rows.append(Chunk([int(rng.integers(0, 50))], int(rng.integers(0, 7 * PS)), pages))
    b = build(rows, num_rows=40, num_tokens=40, table_width=5, page_size=PS, vocab_size=64)
    for r, c in enumerate(rows):
        want = slot_mapping(c.pages, np.array([c.start]), PS)[0]
        assert b.attn.slot_mapping[r] == want


def test_decode_steps_with_kept_tables_match_a_fresh_build():
    """A step of plain decode rows is laid out column by column and its block tables are kept
    between steps (rewritten only where a row's pages changed): every array equals the
    row-by-row build of the same rows from nothing, step after step, as rows gain pages, swap
    one in place (copy-on-write), leave and come back (64-bit seeds split exactly)."""
    rng = np.random.default_rng(1)
    width, vocab = 6, 64
    defaults = Defaults.make(8, vocab, np.asarray, table_width=width)
    pages = [rng.integers(1, 100, rng.integers(0, 4)).tolist() for _ in range(8)]
    for step in range(12):
        n = int(rng.integers(1, 9))
        for p in pages:
            if rng.random() < 0.4 and len(p) < width:
                p.append(int(rng.integers(1, 100)))  # a new page, in place
            if p and rng.random() < 0.2:
                p[-1] = int(rng.integers(1, 100))  # copy-on-write: same length, another page
        rows = [
            Chunk(
                [int(rng.integers(0, vocab))],
                int(rng.integers(0, (width + 1) * PS)),  # past the table too: the dummy page
                pages[r],
                (float(rng.random()), int(rng.integers(0, 5)), 0.9, int(rng.integers(0, 2**63)), step),
            )
            for r in range(n)
        ]
        feed = rng.integers(-1, 8, n).tolist()
        kw = dict(num_rows=8, num_tokens=8, table_width=width, page_size=PS, vocab_size=vocab, feed=feed)
        fast, slow = build(rows, defaults=defaults, **kw), build(rows, **kw)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fast), jax.tree.leaves(slow)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {step} {path}")


def test_default_token_buckets_by_backend():
    """On the CPU: 1 and 8, the powers of two, and 1.5x each power from 256 (a step of 16
    decodes and a 256-token chunk pads to 384, not 512; the default 256 budget gets none, so
    no executable more at warm-up); elsewhere the powers of two."""
    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.runner.runner_config import _token_buckets

    assert _token_buckets(EngineConfig(), "cpu") == (1, 8, 16, 32, 64, 128, 256)
    assert _token_buckets(EngineConfig(max_num_batched_tokens=1024), "cpu")[-4:] == (384, 512, 768, 1024)
    assert _token_buckets(EngineConfig(max_num_batched_tokens=512), "cpu")[-3:] == (256, 384, 512)
    assert _token_buckets(EngineConfig(max_num_batched_tokens=64), "cpu") == (1, 8, 16, 32, 64)
    assert _token_buckets(EngineConfig(), "gpu") == (16, 32, 64, 128, 256, 512)
