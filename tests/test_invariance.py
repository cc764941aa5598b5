"""Batch invariance as a property (docs/sampling.md, "The same tokens however the work is
batched"): a request's tokens equal those of the same request run alone, whatever else is in
the batch, how its prompt is chunked, what the prefix cache holds, whether and how far steps
speculate, how many decode steps one call runs, and which token bucket pads the step; greedy
and seeded sampling, in float32 and in the host's bfloat16. The oracle is a plain engine running the request by itself."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from conftest import SMOLLM2_WIDTHS, bf16_isas, cpu_isa, make_hf_model
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams

BASE = dict(max_slots=8, page_size=8, max_model_len=192, num_pages=300, warmup=False)
# The engines a request is run in: chunk budgets and padding buckets, prefix caching, a cap on
# prompt tokens beside decodes, prompt lookup verifying every proposal (fixed k) or choosing
# per request (adaptive). "alone" is the oracle.
ENGINES = {
    "alone": dict(token_buckets=(8, 16, 32, 64, 128), enable_prefix_caching=False),
    "small-budget": dict(token_buckets=(1, 8, 16, 32)),
    "fixed-lookup": dict(
        token_buckets=(16, 64),
        speculative_model="ngram",
        num_speculative_tokens=3,
        speculative_adaptive=False,
        prompt_lookup_min=1,
    ),  # fmt: skip
    "adaptive-lookup": dict(
        token_buckets=(8, 16, 32, 64, 128),
        speculative_model="ngram",
        num_speculative_tokens=5,
        max_prefill_tokens_while_decoding=8,
    ),  # fmt: skip
    # several decode steps in one call whenever every row plainly decodes (runner/decode_loop.py)
    "multi-step": dict(token_buckets=(8, 16, 32, 64), num_scheduler_steps=6),
}
_built: dict[tuple[str, str], LLM] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("invariance")
    make_hf_model("llama", d, seed=11, **SMOLLM2_WIDTHS, num_hidden_layers=2, vocab_size=300, initializer_range=0.05)
    return d


def _precision(dtype: str):
    """float32: the suite's exact path; bfloat16: the host's bfloat16 matmul and pages (its
    default on an AVX512-BF16 or AMX CPU)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    isas = bf16_isas()
    if not isas:
        pytest.skip("this host has neither AVX512-BF16 nor AMX")
    return cpu_isa(isas[-1])


def _engine(model_dir, dtype: str, name: str) -> LLM:
    key = (dtype, name)
    if key not in _built:
        _built[key] = LLM(model_dir, **BASE, **ENGINES[name])
        assert _built[key].runner.cfg.matmul_dtype == dtype
    return _built[key]


def _prompt(draw, rng_seed: int, repetitive: bool) -> list[int]:
    rng = np.random.default_rng(rng_seed)
    base = [int(x) for x in rng.integers(3, 299, int(rng.integers(4, 40)))]
    return (base * 3)[:90] if repetitive else base


request = st.tuples(
    st.integers(0, 10**6),  # prompt seed
    st.booleans(),  # repetitive: prompt lookup proposes
    st.sampled_from([None, 0.7, 1.0]),  # greedy, or the temperature of a seeded draw
    st.integers(4, 40),  # max_tokens
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=8)
@given(
    target=request,
    crowd=st.lists(request, max_size=6),
    where=st.integers(0, 6),
    engine=st.sampled_from(["small-budget", "fixed-lookup", "adaptive-lookup", "multi-step"]),
    warm_prefix=st.booleans(),
)
def test_a_request_gets_its_tokens_alone_in_any_batch(model_dir, dtype, target, crowd, where, engine, warm_prefix):
    def params(r, seed):
        _, _, temp, n = r
        if temp is None:
            return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return SamplingParams(max_tokens=n, temperature=temp, top_p=0.9, seed=seed, ignore_eos=True)

    with _precision(dtype):
        alone = _engine(model_dir, dtype, "alone")
        llm = _engine(model_dir, dtype, engine)
        prompt = _prompt(None, target[0], target[1])
        want = alone.generate([prompt], params(target, 1234))[0].token_ids
        llm.flush_prefix_cache()
        if warm_prefix:  # the cache holds the target's prompt (and another request's after it)
            llm.generate([prompt[: max(1, len(prompt) - 5)]], SamplingParams(max_tokens=3, temperature=0))
        prompts = [_prompt(None, r[0], r[1]) for r in crowd]
        sps = [params(r, i) for i, r in enumerate(crowd)]
        at = min(where, len(prompts))
        prompts.insert(at, prompt)
        sps.insert(at, params(target, 1234))
        got = llm.generate(prompts, sps)[at].token_ids
        assert got == want
