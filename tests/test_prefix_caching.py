"""Prefix caching in the engine: identical greedy outputs with caching on and off over
shared-prefix workloads, real cache hits, and every page back after a flush; the shared-pair
tests also with int8 weights and int8 KV pages (both engines of the pair quantized)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

# Nothing here counts compiles: the engines skip warm-up and compile only the shapes they run.
OPTS = dict(max_slots=6, page_size=8, max_model_len=256, num_pages=200, token_buckets=(16, 32, 64), warmup=False)


QUANT = {"float32": {}, "int8": dict(quantization="int8", kv_cache_dtype="int8")}


@pytest.fixture(scope="module", params=list(QUANT))
def pair(tok_model, request):
    opts = {**OPTS, **QUANT[request.param]}
    return LLM(tok_model[0], **opts), LLM(tok_model[0], enable_prefix_caching=False, **opts)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _both(pair, prompts, n=12):
    on, off = pair
    a = on.generate(prompts, _greedy(n))
    b = off.generate(prompts, _greedy(n))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    return a


def _pool_whole(llm):
    llm.flush_prefix_cache()
    llm.allocator.check()
    assert llm.allocator.num_free == llm.allocator.capacity
    local = llm.core.kv.local  # a model with sliding layers: their pool too
    assert local is None or local.num_free == local.capacity


def test_long_shared_system_prompt(pair):
    rng = np.random.default_rng(0)
    system = [int(x) for x in rng.integers(3, 500, 100)]
    first = _both(pair, [system + [7, 8, 9]])  # warms the cache
    outs = _both(pair, [system + [int(x) for x in rng.integers(3, 500, int(rng.integers(1, 20)))] for _ in range(8)])
    assert first[0].num_cached_prompt_tokens == 0
    assert all(o.num_cached_prompt_tokens >= 96 for o in outs)  # 12 whole pages of the system prompt
    assert pair[0].prefix_cache.hit_rate > 0.5
    _pool_whole(pair[0])


def test_multi_turn_conversation_reuses_answers(pair):
    rng = np.random.default_rng(1)
    history = [int(x) for x in rng.integers(3, 500, 30)]
    for turn in range(4):
        out = _both(pair, [history])[0]
        if turn:
            # the previous prompt *and answer* were cached (all but the partial last page)
            assert out.num_cached_prompt_tokens >= len(history) - 8 - 6 - 1
        history = history + out.token_ids + [int(x) for x in rng.integers(3, 500, 6)]
    _pool_whole(pair[0])


def test_prompts_sharing_less_than_a_page(pair):
    rng = np.random.default_rng(2)
    stem = [11, 12, 13, 14, 15]
    _both(pair, [stem + [int(x) for x in rng.integers(3, 500, 9)]])
    outs = _both(pair, [stem + [int(x) for x in rng.integers(3, 500, 9)] for _ in range(4)])
    assert all(o.num_cached_prompt_tokens == 5 for o in outs)  # a partial page, copied on write
    _pool_whole(pair[0])


def test_identical_prompts_at_once(pair):
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 500, 40)]
    outs = _both(pair, [prompt] * 6)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    again = _both(pair, [prompt] * 2)
    assert all(o.num_cached_prompt_tokens == 39 for o in again)
    _pool_whole(pair[0])


def test_cache_pressure_evicts_and_stays_correct(tok_model):
    opts = {**OPTS, "max_slots": 4, "num_pages": 40}
    small = LLM(tok_model[0], **opts)
    off = LLM(tok_model[0], enable_prefix_caching=False, **opts)
    rng = np.random.default_rng(4)
    prompts = [[int(x) for x in rng.integers(3, 500, int(rng.integers(20, 90)))] for _ in range(10)]
    prompts += [p[:50] + [1, 2, 3] for p in prompts[:5]]
    a = small.generate(prompts, _greedy(20))
    b = off.generate(prompts, _greedy(20))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    _pool_whole(small)
