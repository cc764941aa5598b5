"""Adaptive prompt lookup's host side (engine/spec_policy.py), without jax: the incremental
index proposes what speculative.ngram_propose does, shadow windows measure acceptance in plain
steps, and the step choice follows the cost table and the records."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.engine.spec_policy import NgramIndex, SpecPolicy, StepCosts
from jaxserve.runner.speculative import ngram_propose

pytestmark = pytest.mark.fast


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 6))
def test_index_proposes_what_ngram_propose_does(tokens, k):
    """Grown token by token (as a request's output is), the index gives the drafts of the
    reference search at every length, for the same n's."""
    index = NgramIndex((3, 2))
    for end in range(1, len(tokens) + 1):
        drafts, match = index.propose(tokens[:end], k)
        assert drafts == ngram_propose(tokens[:end], k, max_n=3, min_n=2)
        assert (match >= 2) == bool(drafts)


def test_match_length_counts_back_past_n():
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5]  # the suffix 1..5 occurred before, after 9 vs 0
    drafts, match = NgramIndex((3, 2)).propose(tokens, 3)
    assert drafts == [6, 7, 8] and match == 5


def costs(spec_per_token: float) -> StepCosts:
    """A plain step of B rows costs 1 + 0.05 (B - 1); a verify step of T tokens 1 + c (T - 1)."""
    return StepCosts(
        {
            "plain": {b: 1 + 0.05 * (b - 1) for b in (1, 2, 4, 8, 16)},
            "spec": {t: 1 + spec_per_token * (t - 1) for t in (2, 4, 8, 16, 32, 64)},
        }
    )


def test_choose_takes_nothing_when_drafts_do_not_pay_and_all_where_they_do():
    policy = SpecPolicy(7, 2, 3, costs(0.08))
    assert policy.choose([(7, 0.1, 1.0)]) is None  # chat: one draft in ten right
    assert policy.choose([(7, 0.97, 1.0)]) == [7]  # a long match that continues
    assert policy.choose([(0, 0.9, 1.0)]) is None  # nothing proposed
    mixed = policy.choose([(7, 0.95, 1.0), (7, 0.1, 1.0), (3, 0.9, 1.0)])
    assert mixed is not None and mixed[0] >= 5 and mixed[1] == 0 and mixed[2] >= 1
    # a verify token that costs what a decode step costs never pays
    assert SpecPolicy(7, 2, 3, costs(1.0)).choose([(7, 0.9, 1.0)]) is None


def test_choose_backs_off_with_the_batch():
    """At batch 8 the plain step's rows are nearly free and drafts are not: fewer drafts pay."""
    policy = SpecPolicy(7, 2, 3, costs(0.06))
    one = policy.choose([(7, 0.7, 1.0)])
    eight = policy.choose([(7, 0.7, 1.0)] * 8)
    assert one is not None and sum(one) >= 2
    assert eight is None or sum(eight) / 8 < sum(one)


def test_shadow_windows_measure_acceptance_in_plain_steps():
    """A request whose output copies its prompt gets a high estimate, one that does not a low
    one, from the tokens alone (no verify step ran)."""
    prompt = list(range(10, 40))
    policy = SpecPolicy(4, 2, 3)
    copying = prompt + prompt[:20]
    for end in range(len(prompt) + 1, len(copying) + 1):  # one token a step, as plain decoding
        policy.observe("copy", copying[:end], len(prompt))
    fresh = prompt + [10, 11] + [99 - i for i in range(18)]  # matches at first, then diverges
    for end in range(len(prompt) + 1, len(fresh) + 1):
        policy.observe("fresh", fresh[:end], len(prompt))
    _, a_copy = policy.propose("copy", copying)
    assert a_copy > 0.8
    st_fresh = policy.state("fresh")
    assert st_fresh.proposing < policy.state("copy").proposing
    assert policy.worth_trying(["copy"])
    policy.forget("copy")
    assert "copy" not in policy.seqs


def test_step_costs_interpolate_and_follow_measurements():
    c = StepCosts({"plain": {1: 1.0, 8: 2.0}, "spec": {2: 1.0, 8: 1.6}})
    assert c.cost("spec", 5) == 1.3
    assert c.cost("spec", 14) == 2.2  # past the last two: extrapolated
    for _ in range(50):
        c.observe("plain", 1, 3.0)
    assert abs(c.cost("plain", 1) - 3.0) < 1e-3
