"""Device sampling against numpy: top-k/top-p sets, greedy, seeds, and the sampled distribution."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from jaxserve.runner import sampling
from jaxserve.runner.sampling import _filter_top_k_top_p, sample
from jaxserve.runner.step_batch import SamplingMetadata


def _np_allowed(row, k, p):
    order = np.argsort(-row, kind="stable")
    keep = order[: k if k > 0 else len(row)]
    probs = np.exp(row[keep] - row[keep].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    return set(keep[(before < p) | (p >= 1)].tolist()) or {int(order[0])}  # p=1 keeps all (no float shortfall)


def test_top_k_top_p_sets_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    top_k = np.array([0, 1, 5, 0, 10, 50], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.5, 0.8, 0.05], np.float32)
    out = np.asarray(_filter_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for i in range(6):
        allowed = set(np.nonzero(np.isfinite(out[i]))[0].tolist())
        assert allowed == _np_allowed(logits[i], int(top_k[i]), float(top_p[i])), i


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.lists(
        st.tuples(st.sampled_from([0, 1, 7, 255, 256, 257, 900, 1000]), st.sampled_from([1.0, 0.95, 0.5, 0.01])),
        min_size=1,
        max_size=5,
    ),
    peaked=st.booleans(),
)
def test_top_k_top_p_past_the_candidates_match_numpy(seed, rows, peaked):
    """Rows a vocabulary wider than TOP_CANDIDATES: a top-k past the candidates, and (flat
    rows) a top-p mass spread past them, take the sort; the rest are decided by the candidates;
    a batch may mix both. Every row's set is NumPy's."""
    assert sampling.TOP_CANDIDATES == 256  # the k values above straddle it
    rng = np.random.default_rng(seed)
    v = 1000
    logits = rng.normal(size=(len(rows), v)).astype(np.float32) * (6.0 if peaked else 0.3)
    logits[:, rng.integers(0, v, 3)] += 1.0  # ties and a few standouts
    logits = np.round(logits, 2)
    top_k = np.array([k for k, _ in rows], np.int32)
    top_p = np.array([p for _, p in rows], np.float32)
    out = np.asarray(jax.jit(_filter_top_k_top_p)(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for i in range(len(rows)):
        allowed = set(np.nonzero(np.isfinite(out[i]))[0].tolist())
        want = _np_allowed(logits[i], int(top_k[i]), float(top_p[i]))
        threshold = min(logits[i][j] for j in want)  # ties with the smallest kept logit stay
        assert allowed == set(np.nonzero(logits[i] >= threshold)[0].tolist()), i


def _run(logits, temp, seeds, counters, top_k=None, top_p=None):
    s, v = logits.shape
    meta = SamplingMetadata.make(
        s,
        v,
        temperature=temp,
        top_k=top_k if top_k is not None else np.zeros(s),
        top_p=top_p if top_p is not None else np.ones(s),
        seeds=seeds,
        counters=counters,
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
            dataclasses.replace(SamplingMetadata.make(n, 8, temperature=np.full(n, temp)), counters=c),
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


def _np_controls(logits, rows):
    """NumPy reference of apply_controls: per row, repetition penalty (transformers' processor)
    over `seen`, presence/frequency over `counts`, logit bias, min_tokens bans, grammar mask."""
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    out = logits.astype(np.float64).copy()
    for i, r in enumerate(rows):
        seen = list(r.get("seen", ()))
        if seen:
            proc = RepetitionPenaltyLogitsProcessor(r.get("rep", 1.0))
            out[i] = proc(torch.tensor([seen]), torch.tensor(logits[i : i + 1], dtype=torch.float32)).numpy()[0]
        for t, c in r.get("counts", {}).items():
            out[i, t] -= r.get("freq", 0.0) * c + r.get("pres", 0.0) * (c > 0)
        for t, b in r.get("bias", {}).items():
            out[i, t] = -np.inf if b <= -100 else out[i, t] + b
        if r.get("counter", 0) < r.get("min_tokens", 0):
            out[i, list(r.get("stop", ()))] = -np.inf
        if "allowed" in r:
            ban = np.ones(out.shape[1], bool)
            ban[list(r["allowed"])] = False
            out[i, ban] = -np.inf
    return out


def _meta_and_mask(rows, v, temperature=None):
    from jaxserve.runner.step_batch import PENALTY_TOKENS, SamplingMetadata

    s = len(rows)
    f = dict(
        repetition_penalty=np.ones(s),
        presence_penalty=np.zeros(s),
        frequency_penalty=np.zeros(s),
        min_tokens=np.zeros(s),
        counters=np.zeros(s),
        min_p=np.zeros(s),
    )
    ids = np.full((s, PENALTY_TOKENS), v)
    counts = np.zeros((s, PENALTY_TOKENS))
    bias_ids, bias_vals = np.full((s, 64), v), np.zeros((s, 64))
    stop_ids = np.full((s, 16), v)
    mask = np.full((s, (v + 31) // 32), -1, np.int32)
    for i, r in enumerate(rows):
        f["repetition_penalty"][i] = r.get("rep", 1.0)
        f["presence_penalty"][i], f["frequency_penalty"][i] = r.get("pres", 0.0), r.get("freq", 0.0)
        f["min_tokens"][i], f["counters"][i] = r.get("min_tokens", 0), r.get("counter", 0)
        f["min_p"][i] = r.get("min_p", 0.0)
        seen = list(dict.fromkeys(r.get("seen", ())))
        ids[i, : len(seen)] = seen
        counts[i, : len(seen)] = [r.get("counts", {}).get(t, 0) for t in seen]
        b = r.get("bias", {})
        bias_ids[i, : len(b)] = list(b)
        bias_vals[i, : len(b)] = [-np.inf if x <= -100 else x for x in b.values()]
        stop_ids[i, : len(r.get("stop", ()))] = list(r.get("stop", ()))
        if "allowed" in r:
            bits = np.zeros(mask.shape[1] * 32, np.uint8)
            bits[list(r["allowed"])] = 1
            mask[i] = np.packbits(bits, bitorder="little").view(np.int32)
    meta = SamplingMetadata.make(
        s,
        v,
        **f,
        penalty_ids=ids,
        penalty_counts=counts,
        bias_ids=bias_ids,
        bias_values=bias_vals,
        stop_ids=stop_ids,
        temperature=temperature if temperature is not None else np.zeros(s),
    )
    return meta, mask


CONTROL_ROWS = [
    {},  # no controls: exact no-op
    {"rep": 1.3, "seen": [1, 5, 7, 5, 40], "counts": {5: 2, 40: 1}},
    {"rep": 0.8, "seen": [2, 3], "pres": 0.5, "freq": 0.25, "counts": {2: 3, 3: 1}},
    {"pres": -1.0, "freq": 1.5, "seen": [9, 10, 11], "counts": {9: 1, 10: 4}},
    {"bias": {4: 5.0, 6: -100.0, 8: -2.5}},
    {"min_tokens": 3, "counter": 1, "stop": [1, 12]},  # stop ids banned
    {"min_tokens": 3, "counter": 3, "stop": [1, 12]},  # reached: nothing banned
    {"allowed": [0, 3, 33, 63]},  # grammar bitmask (words 0 and 1)
    {"allowed": [1, 12], "min_tokens": 5, "stop": [1, 12]},  # the min_tokens ban yields to the grammar
]


def test_controls_equal_a_numpy_reference_row_by_row():
    from jaxserve.runner.sampling import apply_controls

    v = 70
    logits = np.random.default_rng(5).normal(size=(len(CONTROL_ROWS), v)).astype(np.float32) * 3
    meta, mask = _meta_and_mask(CONTROL_ROWS, v)
    got = np.asarray(jax.jit(apply_controls)(jnp.asarray(logits), meta, jnp.asarray(mask)))
    ref = _np_controls(logits[:-1], CONTROL_ROWS[:-1])
    ref = np.concatenate([ref, np.where(np.isin(np.arange(v), [1, 12]), logits[-1], -np.inf)[None]])
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert (got[0] == logits[0]).all()  # bit for bit: a row without controls samples what it did before


def test_min_p_keeps_the_numpy_set_and_greedy_ignores_it():
    from jaxserve.runner.sampling import filter_min_p

    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, 40)).astype(np.float32) * 2
    min_p = np.array([0.0, 0.05, 0.3, 0.9], np.float32)
    out = np.asarray(filter_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    for i in range(4):
        p = np.exp(logits[i] - logits[i].max())
        assert set(np.nonzero(np.isfinite(out[i]))[0]) == set(np.nonzero(p >= min_p[i] * p.max())[0]), i
    # in the sampler, min_p applies to sampled rows; greedy rows keep their argmax
    meta, _ = _meta_and_mask([{"min_p": 0.9}] * 4, 40, temperature=np.array([0, 1, 1, 0.5]))
    meta = dataclasses.replace(meta, seeds=jnp.arange(8, dtype=jnp.uint32).reshape(4, 2))
    toks = np.asarray(sample(jnp.asarray(logits), meta, do_sample=True, num_logprobs=0)[0])
    assert toks[0] == logits[0].argmax()
    for i in (1, 2, 3):  # at min_p 0.9 only tokens within a factor 0.9 of the top one survive
        t = logits[i] / [1, 1, 1, 0.5][i]
        assert t[toks[i]] >= t.max() + np.log(0.9) - 1e-6


def test_bitmask_applies_to_greedy_and_sampled_rows():
    v = 100
    logits = np.random.default_rng(7).normal(size=(4, v)).astype(np.float32)
    rows = [{"allowed": [17, 83]}, {"allowed": [5]}, {}, {"allowed": list(range(50, 100))}]
    for temp in (np.zeros(4), np.ones(4)):
        meta, mask = _meta_and_mask(rows, v, temperature=temp)
        meta = dataclasses.replace(meta, seeds=jnp.arange(8, dtype=jnp.uint32).reshape(4, 2))
        toks = np.asarray(sample(jnp.asarray(logits), meta, jnp.asarray(mask), do_sample=True, num_logprobs=0)[0])
        assert toks[0] in (17, 83) and toks[1] == 5 and toks[3] >= 50
        if not temp.any():
            assert toks[0] == max((17, 83), key=lambda t: logits[0, t]) and toks[2] == logits[2].argmax()


def test_sampling_params_reject_non_finite_and_out_of_range_values():
    import pytest

    from jaxserve.engine.request import SamplingParams

    nan, inf = float("nan"), float("inf")
    for field, bad in [
        ("temperature", nan),
        ("temperature", inf),
        ("temperature", -1.0),
        ("top_p", nan),
        ("min_p", nan),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", inf),
        ("presence_penalty", 2.5),
        ("presence_penalty", nan),
        ("frequency_penalty", -inf),
        ("min_tokens", -1),
        ("min_tokens", 99),
        ("top_k", -2),
        ("top_k", 2**31),  # the step holds it as int32: refused here, not in the step
        ("top_k", -1.0),
        ("max_tokens", 2**31),
        ("n", 0),
        ("logit_bias", {3: nan}),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {i: 1.0 for i in range(65)}),
        ("json_schema", "{not json"),
        ("json_schema", "[1, 2]"),
        ("regex", ""),
    ]:
        with pytest.raises(ValueError, match=field.split("[")[0]):
            SamplingParams(**{field: bad})
    with pytest.raises(ValueError, match="only one of"):
        SamplingParams(regex="a", json_object=True)
    ok = SamplingParams(logit_bias={"7": -100}, json_schema={"type": "object"}, n=3, min_tokens=2)
    assert ok.logit_bias == {7: -100.0} and ok.constraint == ("json_schema", '{"type":"object"}')
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "top-k off"


def test_argmax_is_numpys_first_index_with_ties_and_ragged_blocks():
    from jaxserve.runner.sampling import argmax

    rng = np.random.default_rng(8)
    for v in (1, 5, 127, 128, 129, 300, 1000):
        x = rng.integers(-3, 3, size=(6, v)).astype(np.float32)  # many ties
        x[1] = -np.inf  # every token banned: index 0, as numpy
        x[2, v // 2] = 40.0  # the maximum in the middle
        x[3, -1] = 50.0  # the maximum in the padded last block
        for block in (4, 128):
            got = np.asarray(jax.jit(argmax, static_argnums=1)(jnp.asarray(x), block))
            want = x.argmax(-1)
            np.testing.assert_array_equal(got, want, err_msg=f"v={v} block={block}")


def test_each_control_alone_is_seen_and_applied_by_the_greedy_sampler():
    """The step skips apply_controls when no row has a control (any_controls): each control
    alone must turn it on and change the greedy token, and no control must leave it off."""
    from jaxserve.runner.sampling import any_controls

    v = 70
    logits = np.zeros((1, v), np.float32)
    logits[0, 3], logits[0, 0] = 0.5, 0.4  # the unconstrained argmax, and the runner-up
    cases = {
        "none": ({}, 3),
        "repetition": ({"rep": 100.0, "seen": [3]}, 0),
        "presence": ({"pres": 9.0, "seen": [3], "counts": {3: 1}}, 0),
        "bias": ({"bias": {9: 10.0}}, 9),
        "min_tokens": ({"min_tokens": 2, "stop": [3]}, 0),
        "min_tokens met": ({"min_tokens": 2, "counter": 2, "stop": [3]}, 3),
        "bitmask": ({"allowed": [40]}, 40),
    }
    for name, (row, want) in cases.items():
        meta, mask = _meta_and_mask([row], v)
        on = bool(any_controls(meta, jnp.asarray(mask), v))
        assert on == (name not in ("none", "min_tokens met")), name
        tok = jax.jit(lambda x, m, b: sample(x, m, b, do_sample=False, num_logprobs=0)[0])(
            jnp.asarray(logits), meta, jnp.asarray(mask)
        )
        assert int(tok[0]) == want, name
