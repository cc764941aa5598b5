"""Device sampling against numpy: top-k/top-p sets, greedy, seeds, and the sampled distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jaxserve.runner.sampling import _filter_top_k_top_p, sample
from jaxserve.runner.step_batch import SamplingMetadata


def _np_allowed(row, k, p):
    order = np.argsort(-row, kind="stable")
    keep = order[: k if k > 0 else len(row)]
    probs = np.exp(row[keep] - row[keep].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    return set(keep[before < p].tolist()) or {int(order[0])}


def test_top_k_top_p_sets_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    top_k = np.array([0, 1, 5, 0, 10, 50], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.5, 0.8, 0.05], np.float32)
    out = np.asarray(_filter_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for i in range(6):
        allowed = set(np.nonzero(np.isfinite(out[i]))[0].tolist())
        assert allowed == _np_allowed(logits[i], int(top_k[i]), float(top_p[i])), i


def _run(logits, temp, seeds, counters, top_k=None, top_p=None):
    s = logits.shape[0]
    meta = SamplingMetadata(
        jnp.asarray(temp, jnp.float32),
        jnp.asarray(top_k if top_k is not None else np.zeros(s), jnp.int32),
        jnp.asarray(top_p if top_p is not None else np.ones(s), jnp.float32),
        jnp.asarray(seeds, jnp.uint32),
        jnp.asarray(counters, jnp.int32),
    )
    return np.asarray(sample(jnp.asarray(logits), meta, do_sample=True, num_logprobs=0)[0])


def test_temperature_zero_is_argmax_even_in_sampling_mode():
    logits = np.random.default_rng(1).normal(size=(4, 30)).astype(np.float32)
    toks = _run(logits, np.zeros(4), np.zeros((4, 2)), np.zeros(4))
    assert (toks == logits.argmax(-1)).all()


def test_same_seed_same_token_whatever_the_row():
    logits = np.tile(np.random.default_rng(2).normal(size=(1, 30)).astype(np.float32), (4, 1))
    seeds = np.array([[7, 0], [7, 0], [8, 0], [7, 0]])
    counters = np.array([3, 3, 3, 4])
    toks = _run(logits, np.ones(4), seeds, counters)
    many = [_run(logits[:1], np.ones(1), seeds[:1], counters[:1])[0] for _ in range(3)]
    assert toks[0] == toks[1] == many[0] == many[1] == many[2]


def test_sampled_distribution_matches_softmax():
    rng = np.random.default_rng(3)
    row = rng.normal(size=8).astype(np.float32)
    n = 4000
    logits = np.tile(row, (n, 1))
    temp = 0.7
    toks = jax.jit(
        lambda c: sample(
            jnp.asarray(logits),
            SamplingMetadata(
                jnp.full((n,), temp), jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros((n, 2), jnp.uint32), c
            ),
            do_sample=True,
            num_logprobs=0,
        )[0]
    )(jnp.arange(n, dtype=jnp.int32))
    counts = np.bincount(np.asarray(toks), minlength=8)
    row = row.astype(np.float64)
    p = np.exp(row / temp - (row / temp).max())
    p /= p.sum()
    assert stats.chisquare(counts, p * n).pvalue > 1e-3
    # and the test has power: a wrong temperature is rejected
    q = np.exp(row - row.max())
    q /= q.sum()
    assert stats.chisquare(counts, q * n).pvalue < 1e-3
