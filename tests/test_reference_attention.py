"""The XLA serving-path attention (chunked, online softmax) against the gather-everything oracle,
and the oracle against a dense computation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import reference


@settings(max_examples=12, deadline=None)  # each example compiles new shapes (~4 s here)
@given(
    seed=st.integers(0, 1000),
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    ratio=st.sampled_from([1, 2, 4]),
    ps=st.sampled_from([4, 8]),
    pages=st.integers(1, 7),
)
def test_chunked_matches_gathering_oracle(seed, b, t, ratio, ps, pages):
    rng = np.random.default_rng(seed)
    kvh, d = 2, 16
    h = kvh * ratio
    n = 40
    kp = rng.normal(size=(n, ps, kvh, d)).astype(np.float32)
    vp = rng.normal(size=(n, ps, kvh, d)).astype(np.float32)
    width = pages + pages % 2
    bt = np.zeros((b, width), np.int32)
    ctx = rng.integers(1, pages * ps + 1, b).astype(np.int32)
    for i in range(b):
        bt[i, :pages] = rng.choice(np.arange(1, n), pages, replace=False)
    pos = np.maximum(ctx[:, None] - t + np.arange(t)[None], 0).astype(np.int32)
    # poison: every page that no table row uses, and the dummy page 0
    used = set(bt[bt > 0].tolist())
    for p in range(n):
        if p not in used:
            kp[p] = np.nan
            vp[p] = 1e30
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    want = reference.paged_attention(*(jnp.asarray(x) for x in (q, kp, vp, bt[:, :pages], ctx, pos)), 0.25)
    got = reference.paged_attention_chunked(*(jnp.asarray(x) for x in (q, kp, vp, bt, ctx, pos)), 0.25)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_oracle_matches_dense_softmax():
    rng = np.random.default_rng(0)
    ps, kvh, g, d = 4, 2, 2, 8
    kp = rng.normal(size=(6, ps, kvh, d)).astype(np.float32)
    vp = rng.normal(size=(6, ps, kvh, d)).astype(np.float32)
    bt = np.array([[3, 1, 5]], np.int32)
    ctx = np.array([10], np.int32)
    q = rng.normal(size=(1, 1, kvh * g, d)).astype(np.float32)
    out = np.asarray(reference.paged_attention(q, kp, vp, bt, ctx, np.array([[9]]), 0.5))
    k = kp[bt[0]].reshape(-1, kvh, d)[:10]
    v = vp[bt[0]].reshape(-1, kvh, d)[:10]
    for hh in range(kvh * g):
        s = k[:, hh // g] @ q[0, 0, hh] * 0.5
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(out[0, 0, hh], p @ v[:, hh // g], atol=1e-5)
