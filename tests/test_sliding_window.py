"""Sliding-window attention in every attention backend the CPU runs, against the jnp oracle.

The oracle (`reference.ragged_paged_attention` with `sliding_window`) is itself checked
against a brute-force NumPy loop of the rule (token n sees key j iff j < seq_len, j <= pos and
j > pos - W). Then the XLA serving loop (`ragged_paged_attention_chunked`), the native C++
kernel (every vector instruction set this host has) and the Pallas ragged kernel (both
lowerings, interpreted) against the oracle, over one flat batch mixing decode rows, a
verification row, prefill chunks and padding, windows from 1 key to wider than any context;
contexts past 1,024 keys make the native kernel split a row's keys into partitions, some of them
wholly before the window. Pages no live context reaches hold NaN, as in the kernels' own tests.
The Pallas lowerings are exported for TPU and GPU with a window. A window of None or 0 is full
attention (the unchanged path the other tests cover)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_isa
from paged_pools import close, page_pool, randn
from test_ragged_paged_attention import RaggedMeta, export_for

from jaxserve.runner.attention import make, paged_forward
from pallas_kernels import native, reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

pytestmark = pytest.mark.fast

WINDOWS = [1, 7, 8, 37, 300, 5000]  # 5000: wider than every context (full attention)
_oracle = jax.jit(reference.ragged_paged_attention, static_argnums=7, static_argnames="sliding_window")


def mixed_batch(rng, qlens, ctxs, pad=3, ps=8, kvh=2, ratio=2, d=32):
    """Rows of qlens[r] tokens ending a context of ctxs[r] keys, then `pad` padding tokens (NaN
    queries). Returns (q, clean pages, poisoned pages, index arrays)."""
    k, v, kb, vb, bt = page_pool(rng, ctxs, ps, kvh, d, jnp.float32, even_width=True)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    pos = np.concatenate([np.arange(c - t, c) for t, c in zip(qlens, ctxs)] + [np.full(pad, 3)])
    n_live = int(qsl[-1])
    q = randn(rng, (n_live + pad, kvh * ratio, d)).at[n_live:].set(jnp.nan)
    idx = (jnp.asarray(qsl), jnp.asarray(ctxs, jnp.int32), bt, jnp.asarray(pos, jnp.int32))
    return q, (k, v), (kb, vb), idx


def brute_force(q, k_pages, v_pages, qsl, seq_lens, bt, pos, scale, window):
    """The rule, one token and one head at a time, in float64."""
    q, kp, vp = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    qsl, seq_lens, bt, pos = (np.asarray(x) for x in (qsl, seq_lens, bt, pos))
    ps, kvh = kp.shape[1], kp.shape[2]
    out = np.zeros_like(q)
    for r in range(len(seq_lens)):
        for n in range(qsl[r], qsl[r + 1]):
            keys = [j for j in range(seq_lens[r]) if j <= pos[n] and (not window or j > pos[n] - window)]
            if not keys:
                continue
            slots = [(bt[r, j // ps], j % ps) for j in keys]
            for h in range(q.shape[1]):
                kh = h // (q.shape[1] // kvh)
                kk = np.stack([kp[p, o, kh] for p, o in slots])
                vv = np.stack([vp[p, o, kh] for p, o in slots])
                s = kk @ q[n, h] * scale
                w = np.exp(s - s.max())
                out[n, h] = w @ vv / w.sum()
    return out


QLENS, CTXS = [1, 4, 40, 1, 17], [90, 33, 120, 8, 17]  # decode, verify, chunks, a fresh prompt


@pytest.mark.parametrize("window", [1, 8, 37])
def test_oracle_matches_the_rule(window):
    rng = np.random.default_rng(window)
    q, (k, v), _, idx = mixed_batch(rng, QLENS, CTXS)
    scale = 1 / math.sqrt(q.shape[-1])
    got = np.asarray(_oracle(q, k, v, *idx, scale, sliding_window=window))
    n_live = int(idx[0][-1])
    want = brute_force(q[:n_live], k, v, *idx[:3], idx[3][:n_live], scale, window)
    np.testing.assert_allclose(got[:n_live], want, atol=2e-5, rtol=2e-5)
    assert (got[n_live:] == 0).all()
    full = np.asarray(_oracle(q, k, v, *idx, scale))
    assert np.abs(full[:n_live] - got[:n_live]).max() > 1e-2  # the window changed the result


def _check_backend(forward, rng, qlens, ctxs, windows, poisoned=True):
    """forward(q, pages, idx, scale, window) against the oracle, reading pages poisoned where no
    live context reaches (poisoned=False: the XLA loop, whose P.V reads whole pages)."""
    q, (k, v), bad, idx = mixed_batch(rng, qlens, ctxs)
    bad = bad if poisoned else (k, v)
    scale = 1 / math.sqrt(q.shape[-1])
    n_live = int(idx[0][-1])
    for w in windows:
        want = np.asarray(_oracle(q, k, v, *idx, scale, sliding_window=w))
        got = np.asarray(forward(q, bad, idx, scale, w))
        assert (got[n_live:] == 0).all(), "padding tokens must give zeros"
        close(got[:n_live], want[:n_live], jnp.float32)


def _through_backend(impl):
    """The engine's attention backend `impl` (runner/attention.py), as a windowed layer calls it."""
    backend = make(impl, interpret=True)

    def forward(q, pages, idx, scale, window):
        return backend.forward(q, None, None, pages, RaggedMeta(*idx), scale=scale, window=window)

    return forward


def _pallas(backend: str, interpret: bool):
    """The `pallas` backend's forward with the lowering picked."""
    kernel = functools.partial(ragged_paged_attention, backend=backend, interpret=interpret)

    def forward(q, pages, idx, scale, window):
        return paged_forward(kernel)(q, None, None, pages, RaggedMeta(*idx), scale=scale, window=window)

    return forward


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_xla_and_native_backends(impl):
    _check_backend(_through_backend(impl), np.random.default_rng(1), QLENS, CTXS, WINDOWS, poisoned=impl == "native")


@pytest.mark.parametrize("isa", native.VECTOR_ISAS)
def test_native_every_vector_variant_and_bfloat16(isa):
    """Each instruction set's code (scalar head dims too: 24), float32 and bfloat16 pages."""
    rng = np.random.default_rng(2)
    q, (k, v), _, idx = mixed_batch(rng, QLENS, CTXS, d=24)
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    with cpu_isa(isa):
        for w in (1, 8, 37):
            for pages, tol in (((k, v), jnp.float32), ((kb, vb), jnp.bfloat16)):
                want = _oracle(q, *pages, *idx, 0.2, sliding_window=w)
                got = native.ragged_paged_attention(q, *pages, *idx, 0.2, sliding_window=w)
                close(got[: int(idx[0][-1])], want[: int(idx[0][-1])], tol)


def test_native_long_contexts_split_into_partitions():
    """Contexts of 1,500-3,000 keys: the native kernel splits a row's keys into partitions of
    1,024 (flash-decoding) and leaves out those wholly before the window."""
    _check_backend(
        _through_backend("native"), np.random.default_rng(3), [1, 1, 9], [3000, 1500, 2100], [5, 100, 1100, 2500]
    )


def test_native_int8_pages():
    rng = np.random.default_rng(4)
    q, (k, v), _, idx = mixed_batch(rng, QLENS, CTXS)
    (qk, sk), (qv, sv) = reference.quantize_kv(k, jnp.int8), reference.quantize_kv(v, jnp.int8)
    want = _oracle(q, qk, qv, *idx, 0.2, sk, sv, sliding_window=8)
    got = native.ragged_paged_attention(q, qk, qv, *idx, 0.2, sk, sv, sliding_window=8)
    n = int(idx[0][-1])
    close(got[:n], want[:n], jnp.float32)


def test_native_query_alone_or_in_a_chunk_same_bits():
    """A decode query and the same query at the end of a chunk agree bit for bit under a
    window too (the chunks before a query's window leave its state untouched)."""
    rng = np.random.default_rng(5)
    k, v, kb, vb, bt = page_pool(rng, [200], 8, 2, 64, jnp.float32)
    q = randn(rng, (30, 4, 64))
    pos = jnp.arange(170, 200, dtype=jnp.int32)
    lens = jnp.asarray([200], jnp.int32)
    chunk = native.ragged_paged_attention(q, kb, vb, jnp.asarray([0, 30]), lens, bt, pos, 0.2, sliding_window=12)
    for t in (0, 13, 29):
        alone = native.ragged_paged_attention(
            q[t : t + 1], kb, vb, jnp.asarray([0, 1]), lens, bt, pos[t : t + 1], 0.2, sliding_window=12
        )
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(chunk[t]))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_pallas_interpreted(backend):
    _check_backend(_pallas(backend, True), np.random.default_rng(6), QLENS, CTXS, [1, 8, 37, 5000])


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("quantized", [False, True])
def test_pallas_lowers_with_a_window(backend, platform, quantized):
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    n, r, num_pages, p, ps, kvh, d = 200, 6, 50, 12, 16, 2, 128
    pages = sd((num_pages, ps, kvh, d), jnp.int8 if quantized else bf)
    cache = (pages, pages) + ((sd((num_pages, ps, kvh), bf),) * 2 if quantized else ())

    def f(q, cache, qsl, sl, bt, pos):
        return _pallas(backend, False)(q, cache, (qsl, sl, bt, pos), 0.1, 64)

    args = (sd((n, kvh * 2, d), bf), cache, sd((r + 1,), i32), sd((r,), i32), sd((r, p), i32), sd((n,), i32))
    exported = export_for(platform, f, *args)
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in exported.mlir_module()
