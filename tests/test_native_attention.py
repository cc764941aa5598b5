"""The native CPU paged-attention kernel (pallas_kernels/native.py over cpu/paged_attention.cc,
called through XLA FFI) against the jnp oracle ``reference.paged_attention``, in its dense layout
(paged_pools.native_dense: rows of T tokens each).

Context lengths 1..2048 that end anywhere in a page, grouped-query ratios 1/2/4/8, head dims
32/64/128 (and odd ones on the scalar path), page sizes 8/16/32, decode (T = 1) and chunks of
T > 1 queries continuing a sequence (positions context_len-T .. context_len-1: chunked prefill,
speculative verification), rows with context length 0 (all-zero output), float32 and bfloat16
pages, every vector variant this host can run, always inside ``jax.jit`` with block tables
wider than needed. Pages no live context reaches (unused pages, the dummy page 0 that padding
entries of the block tables point at, the tail of each last page) hold NaN and must not change
the result.

The ragged entry point (``native.ragged_paged_attention``: one flat token array, rows of
1..256 query tokens mixed in one batch, empty rows, padding tokens past query_start_loc[R];
float32, bfloat16 and int8 pages) against ``reference.ragged_paged_attention``, each row alone
equal bit for bit to the row in a batch, and the serving wrapper inside ``jax.jit``.

The library is built by the install (setup.py) or by ``python -m pallas_kernels.native build``
(``make native``), never at run time: if it is unavailable these tests fail, they do not skip.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_isa
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_pools import close, native_dense, page_pool, quantize_pool, randn

from pallas_kernels import native, reference

MAX_LEN = 2048


_native = jax.jit(native_dense, static_argnums=6)
_oracle = jax.jit(reference.paged_attention, static_argnums=6)


def _check(rng, lens, t, ratio, kvh, d, ps, dtype, extra_cols, q_dtype=None):
    """Rows of the given context lengths, each with a chunk of t queries at positions
    len-t .. len-1 (a row of length 0 is an inactive slot: its queries see nothing)."""
    q_dtype = q_dtype or dtype
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, ps, kvh, d, dtype, extra_cols=extra_cols)
    q = randn(rng, (len(lens), t, kvh * ratio, d), q_dtype)
    cl = jnp.asarray(lens, jnp.int32)
    pos = cl[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    scale = 1 / math.sqrt(d)
    out = _native(q, k_bad, v_bad, bt, cl, pos, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    got = np.asarray(out.astype(jnp.float32))
    # A query sees something iff its row is active and its position is not before the context
    # (a row shorter than the chunk has such queries). The oracle averages every key there.
    sees = (np.asarray(pos) >= 0) & (np.asarray(lens) > 0)[:, None]
    assert (got[~sees] == 0).all(), "a query that sees no key must give zeros"
    want = np.asarray(_oracle(q, k, v, bt, cl, pos, scale).astype(jnp.float32))
    coarse = jnp.bfloat16 if jnp.bfloat16 in (dtype, q_dtype) else jnp.float32
    close(got[sees], want[sees], coarse)
    return got


def test_library_is_available():
    """The install builds the library (`make native` rebuilds it after an edit of the C++)."""
    assert native.available(), native.unavailable_reason()
    assert native.cpu_isa() in native.ISAS
    if native.SOURCE.exists():  # the loaded library was built from this source
        assert native._built_from(native._state["path"], native.source_digest())


_lengths = st.one_of(st.integers(1, MAX_LEN), st.sampled_from([0, 1, 15, 16, 17, 63, 64, 65, MAX_LEN]))


@settings(max_examples=20, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    b=st.integers(1, 4),
    kvh=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 4, 8]),
    d=st.sampled_from([32, 64, 128]),
    ps=st.sampled_from([8, 16, 32]),
    extra_cols=st.integers(0, 3),
)
def test_decode_matches_reference(data, dtype, b, kvh, ratio, d, ps, extra_cols):
    lens = data.draw(st.lists(_lengths, min_size=b, max_size=b), label="context_lens")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    _check(rng, lens, 1, ratio, kvh, d, ps, dtype, extra_cols)


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    b=st.integers(1, 3),
    ratio=st.sampled_from([1, 2, 4, 8]),
    d=st.sampled_from([32, 64, 128]),
    ps=st.sampled_from([8, 16, 32]),
    t=st.one_of(st.integers(2, 8), st.integers(30, 40)),  # > 32 spans two query blocks
    extra_cols=st.integers(0, 2),
)
def test_chunk_matches_reference(data, dtype, b, ratio, d, ps, t, extra_cols):
    """T > 1 queries continuing a sequence: query i sees keys 0 .. len-t+i (causal within the
    chunk). Some rows may be inactive (length 0)."""
    lens = data.draw(
        st.lists(st.one_of(st.integers(t, MAX_LEN), st.just(0)), min_size=b, max_size=b), label="context_lens"
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    _check(rng, lens, t, ratio, 2, d, ps, dtype, extra_cols)


@pytest.mark.parametrize("isa", native.VECTOR_ISAS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_vector_variant(isa, dtype):
    """The baseline, AVX2 and AVX-512 builds of the kernel (those this host can run) agree
    with the oracle, decode and chunk, a page size below the vector width."""
    assert native.available(), native.unavailable_reason()
    best = native.best_cpu_isa()
    if native.ISAS.index(isa) > native.ISAS.index(best):
        pytest.skip(f"this host cannot run {isa} (best: {best})")
    with cpu_isa(isa) as now:
        assert now == isa
        for t in (1, 5):
            _check(np.random.default_rng(7), [300, 0, 41, 1], t, 4, 2, 64, 8, dtype, 1)
            _check(np.random.default_rng(8), [1000, 17], t, 2, 4, 32, 16, dtype, 0)


@pytest.mark.parametrize("d", [8, 16, 40, 96, 256])
def test_other_head_dims(d):
    """Head dims off the main list: 16/96/256 on the vector path, 8/40 on the scalar path."""
    for t, dtype in ((1, jnp.float32), (3, jnp.bfloat16)):
        _check(np.random.default_rng(d), [77, 0, 130], t, 2, 2, d, 16, dtype, 1)


def test_mixed_dtypes():
    """q and pages of different float types: the result has q's dtype; float16 works via a cast."""
    rng = np.random.default_rng(11)
    for q_dtype, page_dtype in ((jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)):
        _check(rng, [200, 33], 1, 2, 2, 64, 16, page_dtype, 1, q_dtype=q_dtype)
    k, v, _, _, bt = page_pool(rng, [50], 16, 2, 32, jnp.float32)
    q = randn(rng, (1, 1, 4, 32), jnp.float16)
    cl = jnp.asarray([50], jnp.int32)
    out = _native(q, k, v, bt, cl, cl[:, None] - 1, 0.2)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(
        np.asarray(out, np.float32),
        np.asarray(reference.paged_attention(q.astype(jnp.float32), k, v, bt, cl, cl[:, None] - 1, 0.2)),
        atol=2e-3,
    )


def test_many_rows_every_split():
    """Many rows of mixed lengths (every thread busy) and every KV-heads-per-item split give
    the same result."""
    rng = np.random.default_rng(5)
    lens = list(rng.integers(0, 1500, size=40))
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, 16, 4, 32, jnp.float32)
    q = randn(rng, (40, 1, 8, 32))
    cl = jnp.asarray(lens, jnp.int32)
    pos = cl[:, None] - 1
    live = np.asarray(lens) > 0
    want = np.asarray(_oracle(q, k, v, bt, cl, pos, 0.17))[live]
    for khi in (0, 1, 2, 4):
        f = jax.jit(lambda *a, khi=khi: native_dense(*a, 0.17, kv_heads_per_item=khi))
        got = np.asarray(f(q, k_bad, v_bad, bt, cl, pos))
        assert (got[~live] == 0).all()
        close(got[live], want, jnp.float32)


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_a_query_gives_the_same_bits_alone_or_in_a_chunk(ratio, d):
    """The kernel takes query rows (heads x queries of a KV head) two at a time where the
    registers allow: a row's arithmetic must not depend on its partner, so a decode step and
    the same query inside a chunk (speculative verification, chunked prefill) agree bit for
    bit. With ratio 1 or 3 the pairs cross queries, so each copy of the query is paired
    differently from the query alone."""
    rng = np.random.default_rng(11)
    lens = [37, 150, 1]
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, 16, 2, d, jnp.float32)
    q = randn(rng, (3, 1, 2 * ratio, d))
    cl = jnp.asarray(lens, jnp.int32)
    pos = cl[:, None] - 1
    alone = np.asarray(_native(q, k_bad, v_bad, bt, cl, pos, 0.2))
    chunk = np.asarray(_native(jnp.tile(q, (1, 3, 1, 1)), k_bad, v_bad, bt, cl, jnp.tile(pos, (1, 3)), 0.2))
    for t in range(3):
        np.testing.assert_array_equal(chunk[:, t], alone[:, 0])


def test_vmap_and_traced_scale():
    """Under vmap (the FFI call runs once per element) and with a scale that is a traced
    value (folded into q)."""
    rng = np.random.default_rng(9)
    k, v, k_bad, v_bad, bt = page_pool(rng, [90, 40], 8, 2, 32, jnp.float32)
    q = randn(rng, (3, 2, 1, 4, 32))
    cl = jnp.asarray([90, 40], jnp.int32)
    pos = cl[:, None] - 1
    got = jax.jit(jax.vmap(lambda q: native_dense(q, k_bad, v_bad, bt, cl, pos, 0.3)))(q)
    want = jax.vmap(lambda q: reference.paged_attention(q, k, v, bt, cl, pos, 0.3))(q)
    close(got, want, jnp.float32)
    got = jax.jit(lambda q, s: native_dense(q, k_bad, v_bad, bt, cl, pos, s))(q[0], jnp.float32(0.3))
    close(got, want[0], jnp.float32)


def test_queries_that_see_nothing_give_zeros():
    """A query whose position is before the context (e.g. padding of a chunk) gets zeros;
    its neighbours are unaffected. Context lengths past the block table are clamped to it."""
    rng = np.random.default_rng(2)
    k, v, k_bad, v_bad, bt = page_pool(rng, [40], 16, 2, 32, jnp.float32, extra_cols=0)
    q = randn(rng, (1, 3, 4, 32))
    cl = jnp.asarray([40], jnp.int32)
    pos = jnp.asarray([[-1, 10, 39]], jnp.int32)
    got = np.asarray(_native(q, k_bad, v_bad, bt, cl, pos, 0.2))
    assert (got[0, 0] == 0).all()
    want = reference.paged_attention(q[:, 1:], k, v, bt, cl, pos[:, 1:], 0.2)
    close(got[:, 1:], want, jnp.float32)
    # context_len beyond the table's 3 pages x 16 tokens: only the table's 48 keys exist
    cl_long = jnp.asarray([1000], jnp.int32)
    got = _native(q[:, 2:], k, v, bt, cl_long, jnp.asarray([[999]], jnp.int32), 0.2)
    want = reference.paged_attention(q[:, 2:], k, v, bt, cl_long, jnp.asarray([[999]], jnp.int32), 0.2)
    close(got, want, jnp.float32)


def test_unavailable_library_warns_once(monkeypatch, caplog):
    """Where the library cannot be built or loaded: available() is False, one warning is
    logged to jaxserve.kernels, and calling the kernel raises a clear error."""
    saved = dict(native._state)
    try:
        native._state.clear()

        def broken():
            raise RuntimeError("no compiler here")

        monkeypatch.setattr(native, "_locate", broken)
        with caplog.at_level(logging.WARNING, logger="jaxserve.kernels"):
            assert not native.available()
            assert not native.available()
        warnings = [r for r in caplog.records if r.name == "jaxserve.kernels"]
        assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()
        with pytest.raises(RuntimeError, match="unavailable"):
            native.ragged_paged_attention(
                jnp.zeros((1, 2, 8)),
                jnp.zeros((2, 4, 1, 8)),
                jnp.zeros((2, 4, 1, 8)),
                jnp.asarray([0, 1], jnp.int32),
                jnp.ones((1,), jnp.int32),
                jnp.zeros((1, 1), jnp.int32),
                jnp.zeros((1,), jnp.int32),
                1.0,
            )
    finally:
        monkeypatch.undo()  # the real _locate again, whatever ran before this test
        native._state.clear()
        native._state.update(saved)
    assert native.available()


def _library_beside(tmp_path, monkeypatch, edit: bool):
    """native's paths pointed at a copy of the library and its sources in tmp_path (one source
    edited if `edit`); returns the copied library."""
    cpu = tmp_path / "cpu"
    cpu.mkdir(parents=True)
    for s in (*native.SOURCES, *native.CPU_DIR.glob("*.h")):
        (cpu / s.name).write_bytes(s.read_bytes() + (b"// edited\n" if edit and s.name == native.SOURCE.name else b""))
    lib = cpu / native.LIB_NAME
    lib.write_bytes(native._state["path"].read_bytes())
    monkeypatch.setattr(native, "CPU_DIR", cpu)
    monkeypatch.setattr(native, "SOURCES", tuple(cpu / s.name for s in native.SOURCES))
    return lib


def test_run_time_never_builds_the_library(tmp_path, monkeypatch):
    """A library built from other sources than the checkout's, or none at all, is refused with
    the command that rebuilds it, and nothing is compiled; the library from these sources loads."""
    assert native.available()
    lib = _library_beside(tmp_path, monkeypatch, edit=False)
    assert native._locate() == lib  # the same sources: current
    lib = _library_beside(tmp_path / "edited", monkeypatch, edit=True)
    with pytest.raises(RuntimeError, match="built from other sources.*python -m pallas_kernels.native build"):
        native._locate()
    lib.unlink()
    with pytest.raises(RuntimeError, match="missing.*python -m pallas_kernels.native build"):
        native._locate()
    sources = (*native.SOURCES, *native.CPU_DIR.glob("*.h"))
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted(s.name for s in sources)  # nothing built


def test_unavailable_library_falls_back_only_when_not_asked_for(monkeypatch):
    """Without the library the CPU's automatic attention is XLA; attention_impl='native' is an
    error that says how to build it."""
    from jaxserve.runner import runner_config

    saved = dict(native._state)
    try:
        native._state.clear()

        def stale():
            raise RuntimeError(f"built from other sources; rebuild it: {native.REBUILD}")

        monkeypatch.setattr(native, "_locate", stale)
        assert runner_config.default_attention("cpu") == "xla"
        assert "python -m pallas_kernels.native build" in native.unavailable_reason()
    finally:
        monkeypatch.undo()  # the real _locate again, whatever ran before this test
        native._state.clear()
        native._state.update(saved)
    assert native.available()


# -- the ragged layout: one flat token array, rows of any query length ------------------------

_ragged = jax.jit(native.ragged_paged_attention, static_argnums=7)
_ragged_oracle = jax.jit(reference.ragged_paged_attention, static_argnums=7)
# The oracle gathers every token's whole context (tokens x table width x KVH x D elements): the
# contexts of a drawn batch are capped so that this stays under ORACLE_BUDGET elements.
ORACLE_BUDGET = 1 << 24


def _ragged_batch(rng, qlens, lens, ps, kvh, d, pad, cols=1):
    """Rows of qlens[r] query tokens (0: an empty row) at positions lens[r] - qlens[r] ..
    lens[r] - 1 (a prefill chunk continuing its sequence, a fresh prompt when they are equal,
    a decode step for one token; positions below 0 see nothing), then `pad` padding tokens
    with NaN queries at arbitrary positions. Returns (k, v, k_bad, v_bad, index arrays)."""
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, ps, kvh, d, jnp.float32, extra_cols=cols)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    pos = [np.arange(n - t, n) for n, t in zip(lens, qlens)] + [rng.integers(0, MAX_LEN, pad)]
    idx = (jnp.asarray(qsl), jnp.asarray(lens, jnp.int32), bt, jnp.asarray(np.concatenate(pos), jnp.int32))
    return k, v, k_bad, v_bad, idx


def _ragged_check(rng, qlens, lens, ratio, kvh, d, ps, dtype, pad, q_dtype=None, isas=(None,)):
    """The kernel (with every instruction set in isas; None: the current one) against the oracle
    on the clean pages, reading pages poisoned wherever no live context reaches."""
    q_dtype = q_dtype or (jnp.float32 if dtype == "int8" else dtype)
    k, v, k_bad, v_bad, idx = _ragged_batch(rng, qlens, lens, ps, kvh, d, pad)
    n_live = int(idx[0][-1])
    q = randn(rng, (n_live + pad, kvh * ratio, d), q_dtype).at[n_live:].set(jnp.nan)
    scale = 1 / math.sqrt(d)
    if dtype == "int8":
        bad, k, v = quantize_pool(k, v, k_bad)
        pages, scales = bad[:2], bad[2:]
    else:
        k, v = k.astype(dtype), v.astype(dtype)
        pages, scales = (k_bad.astype(dtype), v_bad.astype(dtype)), ()
    want = np.asarray(_ragged_oracle(q, k, v, *idx, scale).astype(jnp.float32))
    pos = np.asarray(idx[3])
    rows = np.repeat(np.arange(len(qlens)), qlens)
    sees = np.zeros(len(pos), bool)
    sees[:n_live] = (pos[:n_live] >= 0) & (np.asarray(lens)[rows] > 0)
    coarse = jnp.bfloat16 if jnp.bfloat16 in (dtype, q_dtype) else jnp.float32
    for isa in isas:
        if isa is not None:
            assert native.set_cpu_isa(isa) == isa
        out = _ragged(q, *pages, *idx, scale, *scales)
        assert out.shape == q.shape and out.dtype == q.dtype
        got = np.asarray(out.astype(jnp.float32))
        assert (got[~sees] == 0).all(), "padding tokens and tokens that see no key must give zeros"
        close(got[sees], want[sees], coarse)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    data=st.data(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, "int8"]),
    rows=st.integers(1, 5),
    kvh=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 4, 8]),
    d=st.sampled_from([32, 64, 128]),
    ps=st.sampled_from([8, 16, 32]),
    pad=st.integers(0, 5),
)
def test_ragged_matches_reference(data, dtype, rows, kvh, ratio, d, ps, pad):
    """One batch mixes decode rows (1 token), empty rows (0), short chunks (2..40 tokens) and at
    most one long chunk (200..256 tokens); contexts 1..2048 continuing the chunk, or a fresh
    prompt (context = chunk), or any length 0..2048 (shorter than the chunk: its first tokens
    see nothing); padding tokens past query_start_loc[R]. Contexts are capped to keep the
    oracle's gather under ORACLE_BUDGET elements."""
    short = st.one_of(st.just(1), st.just(0), st.integers(2, 40))
    qlens = data.draw(st.lists(short, min_size=rows, max_size=rows), label="query_lens")
    long_chunk = data.draw(st.one_of(st.none(), st.integers(200, 256)), label="long_chunk")
    if long_chunk is not None:
        qlens[data.draw(st.integers(0, rows - 1), label="long_row")] = long_chunk
    lens = []
    for t in qlens:
        kind = data.draw(st.sampled_from(["continue", "fresh", "any"]), label="context_kind")
        lens.append(t if kind == "fresh" else data.draw(st.integers(t, MAX_LEN) if kind == "continue" else _lengths))
    cap = max(ORACLE_BUDGET // (max(1, sum(qlens) + pad) * kvh * d), max(qlens))
    lens = [min(n, cap) for n in lens]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    _ragged_check(rng, qlens, lens, ratio, kvh, d, ps, dtype, pad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "int8"])
def test_ragged_every_vector_variant(dtype):
    """The baseline, AVX2 and AVX-512 builds (those this host can run) on one mixed batch: decode
    rows, an empty row, a fresh 256-token prompt (its query blocks cut finer to share it out), a
    chunk continuing a long context, padding; scalar path for an odd head dim."""
    best = native.best_cpu_isa()
    isas = [i for i in native.VECTOR_ISAS if native.ISAS.index(i) <= native.ISAS.index(best)]
    with cpu_isa(native.cpu_isa()):  # _ragged_check sets each of isas
        qlens, lens = [1, 0, 256, 1, 37, 1], [900, 300, 256, 1, 1500, 17]
        _ragged_check(np.random.default_rng(3), qlens, lens, 4, 2, 64, 16, dtype, 3, isas=isas)
        _ragged_check(np.random.default_rng(4), [40], [40], 2, 1, 40, 8, dtype, 0, isas=isas)


def _vector_isa() -> str:
    """The best float32 build this host runs: avx512, else avx2, else generic."""
    best = native.best_cpu_isa()
    return native.VECTOR_ISAS[min(native.ISAS.index(best), len(native.VECTOR_ISAS) - 1)]


def _dp_isa() -> str:
    """avx512bf16 (the bfloat16 dot-product variant) where this host has it; skips elsewhere."""
    best = native.best_cpu_isa()
    if native.ISAS.index(best) < native.ISAS.index("avx512bf16"):
        pytest.skip(f"this host has no AVX512-BF16 (best: {best}): a variant test")
    return "avx512bf16"


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_bf16_dot_product_variant_matches_reference(d):
    """bfloat16 pages at the avx512bf16 level take the dot-product variant (K transposed into k
    pairs, V into key pairs, the scaled queries and the probabilities rounded to bfloat16): on a
    mixed batch (decode rows, an empty row, a fresh 256-token prompt, a chunk continuing a long
    context, padding, NaN-poisoned dead slots), every GQA ratio the engine uses, bfloat16 and
    float32 queries, page sizes 8 and 32 (chunks of 64 keys and not), it stays within bfloat16
    tolerance of the oracle. The same head dims with odd ones (40) fall back to the vector code."""
    isa = _dp_isa()
    with cpu_isa(native.cpu_isa()):  # _ragged_check sets isa
        for ratio, ps, q_dtype, seed in ((1, 16, None, 1), (2, 8, jnp.float32, 2), (3, 32, None, 3), (8, 16, None, 4)):
            qlens, lens = [1, 0, 256, 1, 37, 1, 5], [900, 300, 256, 1, 1500, 17, 64]
            if d == 256:
                qlens, lens = [1, 0, 70, 1, 5], [300, 3, 70, 1, 131]
            rng = np.random.default_rng(seed)
            _ragged_check(rng, qlens, lens, ratio, 2, d, ps, jnp.bfloat16, 3, q_dtype=q_dtype, isas=[isa])
        _ragged_check(np.random.default_rng(5), [40, 1], [40, 99], 2, 1, 40, 8, jnp.bfloat16, 0, isas=[isa])


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_dot_product_variant_query_alone_equals_chunk(ratio, d):
    """The dot-product variant blocks up to 6 query rows (3 at head dim 128) and shares each
    packed K and V vector among them: a row's sums must not depend on its block, so a decode
    query and the same query inside a chunk agree bit for bit (what speculative == plain and
    chunked prefill rely on)."""
    isa = _dp_isa()
    rng = np.random.default_rng(12)
    lens = [37, 150, 1, 700]
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, 16, 2, d, jnp.bfloat16)
    q = randn(rng, (4, 1, 2 * ratio, d), jnp.bfloat16)
    cl = jnp.asarray(lens, jnp.int32)
    pos = cl[:, None] - 1
    with cpu_isa(isa) as now:
        assert now == isa
        alone = np.asarray(_native(q, k_bad, v_bad, bt, cl, pos, 0.2).astype(jnp.float32))
        tiled = jnp.tile(q, (1, 7, 1, 1))
        chunk = np.asarray(_native(tiled, k_bad, v_bad, bt, cl, jnp.tile(pos, (1, 7)), 0.2).astype(jnp.float32))
    for t in range(7):
        np.testing.assert_array_equal(chunk[:, t], alone[:, 0])
    vector = np.asarray(_native(q, k_bad, v_bad, bt, cl, pos, 0.2).astype(jnp.float32))
    assert not np.array_equal(alone, vector)  # the variant ran: its bfloat16 roundings show
    close(alone, vector, jnp.bfloat16)


@pytest.mark.parametrize("variant", ["vector", "avx512bf16"])
def test_long_rows_split_into_partitions(variant):
    """Keys past 1,024 are split into partitions of 1,024 (from key 0), one work item each,
    merged at the end (split-K: a batch-1 decode over a long context gives every thread work).
    Rows of 3,000, 1,030 and 2,049 keys (40 queries each; the 1,030 row's straddle the first
    partition's edge) match the oracle, and every query gives the same bits alone as among the
    others: a query's arithmetic depends on its row alone, not on the step around it. "vector"
    is the host's best float32 build (AVX-512, else AVX2, else the baseline)."""
    isa = _dp_isa() if variant == "avx512bf16" else _vector_isa()
    dtype = jnp.bfloat16 if variant == "avx512bf16" else jnp.float32
    rng = np.random.default_rng(21)
    lens, t = [3000, 1030, 2049], 40
    with cpu_isa(isa) as chosen:
        assert chosen == isa
        got = _check(rng, lens, t, 3, 3, 64, 16, dtype, 1)
        k, v, k_bad, v_bad, bt = page_pool(np.random.default_rng(21), lens, 16, 3, 64, dtype, extra_cols=1)
        q = randn(np.random.default_rng(22), (3, t, 9, 64), dtype)
        cl = jnp.asarray(lens, jnp.int32)
        pos = cl[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
        chunk = np.asarray(_native(q, k_bad, v_bad, bt, cl, pos, 0.125).astype(jnp.float32))
        for b in range(3):
            for j in (0, 17, 33, t - 1):
                one = (slice(b, b + 1), slice(j, j + 1))
                alone = _native(q[one], k_bad, v_bad, bt[b : b + 1], cl[b : b + 1], pos[one], 0.125)
                np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32))[0, 0], chunk[b, j])
    assert got.shape == (3, t, 9, 64)


def test_ragged_rows_alone_equal_the_batch_bit_for_bit():
    """A row's result does not depend on the other rows of the call (nor on how its queries were
    cut into items): one batch and each row alone agree bit for bit."""
    rng = np.random.default_rng(6)
    lens, t = [300, 1000, 45], 9
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, 16, 2, 64, jnp.float32)
    q = randn(rng, (3, t, 8, 64))
    cl = jnp.asarray(lens, jnp.int32)
    pos = cl[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    qsl = jnp.arange(4, dtype=jnp.int32) * t
    batch = np.asarray(_ragged(q.reshape(3 * t, 8, 64), k_bad, v_bad, qsl, cl, bt, pos.reshape(-1), 0.125))
    batch = batch.reshape(q.shape)
    for b in range(3):
        alone = _ragged(q[b], k_bad, v_bad, jnp.asarray([0, t], jnp.int32), cl[b : b + 1], bt[b : b + 1], pos[b], 0.125)
        np.testing.assert_array_equal(np.asarray(alone), batch[b])


def test_ragged_attention_serving_path_in_jit():
    """The native backend's forward (runner/attention.py over native.ragged_paged_attention) inside
    jax.jit over a layer's cache tuple (float and int8) with duck-typed metadata: other metadata
    of the same shapes reuse the executable."""
    rng = np.random.default_rng(8)
    qlens, lens = [1, 20, 0, 1], [70, 20, 5, 33]
    k, v, k_bad, v_bad, idx = _ragged_batch(rng, qlens, lens, 8, 2, 32, pad=2)
    q = randn(rng, (24, 4, 32))
    md = RaggedMeta(*idx)
    from jaxserve.runner import attention

    forward = attention.make("native").forward
    f = jax.jit(lambda q, kv, md: forward(q, None, None, kv, md, scale=0.2))
    bad8, k8, v8 = quantize_pool(k, v, k_bad)
    for cache, kc, vc in (((k_bad, v_bad), k, v), (bad8, k8, v8)):
        close(f(q, cache, md), _ragged_oracle(q, kc, vc, *idx, 0.2), jnp.float32)
    # Same shapes, other rows: the first row becomes a 2-token chunk, the second 19 tokens.
    md2 = RaggedMeta(jnp.asarray([0, 2, 21, 21, 22], jnp.int32), *idx[1:])
    close(f(q, (k_bad, v_bad), md2), _ragged_oracle(q, k, v, *md2, 0.2), jnp.float32)
    assert f._cache_size() == 2  # float and int8 caches: one executable each


class RaggedMeta(NamedTuple):
    """The fields a backend's forward reads (the engine's metadata class has more)."""

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    positions: jax.Array


def test_ragged_refuses_bad_shapes():
    """Index arrays whose shapes do not fit q and each other: ValueError naming the field (and
    the FFI handler, called directly, refuses them too)."""
    assert native.available()  # loads the library and registers its targets (run alone, nothing has yet)
    rng = np.random.default_rng(1)
    k, v, _, _, idx = _ragged_batch(rng, [3, 1], [10, 5], 8, 1, 32, pad=0)
    q = randn(rng, (4, 2, 32))
    qsl, lens, bt, pos = idx
    for bad, field in (
        ((qsl[:2], lens, bt, pos), "query_start_loc"),
        ((qsl, lens, bt, pos[:3]), "positions"),
        ((qsl, lens, bt[:1], pos), "block_tables"),
        ((qsl, lens[:, None], bt, pos), "seq_lens"),
    ):
        with pytest.raises(ValueError, match=field):
            native.ragged_paged_attention(q, k, v, *bad, 0.2)
    with pytest.raises(ValueError, match="q:"):
        native.ragged_paged_attention(q[None], k, v, *idx, 0.2)
    call = jax.ffi.ffi_call(native.RAGGED_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    with pytest.raises(Exception, match="query_start_loc"):
        attrs = dict(scale=np.float32(0.2), kv_heads_per_item=np.int64(0), window=np.int64(0))
        np.asarray(call(q, k, v, qsl[:2], lens, bt, pos, **attrs))
