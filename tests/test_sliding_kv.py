"""Sliding-window layers' KV pages freed (Gemma 3's local layers): a request many windows long
holds only its window's local pages while it decodes, read from the KV manager, and still gives
transformers' greedy tokens; prefix-cache hits on a sliding model give the tokens a run without
prefix caching gives (and transformers'), with the local pool smaller than the full one, so the
tree's local pages are dropped under pressure. Mistral, every layer sliding, is one local pool
(its full pool's pages hold no bytes). Every page of both pools comes back. The engines skip warm-up (compiles after warm-up
are counted by test_gemma3's engine test, which runs with the local pool too)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_greedy, make_hf_model
from test_gemma3 import WINDOW, make_gemma3

from jaxserve import LLM, SamplingParams
from jaxserve.engine.request import Status
from jaxserve.kv_math import local_pages_per_request

PS = 4
OPTS = dict(max_slots=4, page_size=PS, max_model_len=128, num_pages=120, token_buckets=(8, 16, 32), warmup=False)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3-swa")
    return d, make_gemma3(d, seed=5)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _pools_whole(llm) -> None:
    llm.flush_prefix_cache()
    kv = llm.core.kv
    kv.check([])
    assert kv.alloc.num_free == kv.alloc.capacity
    assert kv.local.num_free == kv.local.capacity


def test_a_request_of_eight_windows_holds_only_its_window(gemma):
    path, hf = gemma
    llm = LLM(path, enable_prefix_caching=False, **OPTS)
    kv, rc = llm.core.kv, llm.runner.cfg
    assert (kv.window, rc.local_window) == (WINDOW, WINDOW)
    assert rc.local_num_pages == 4 * 4 + 32 // PS + 1  # 4 slots x 4 pages, a step's chunks, the dummy
    assert rc.local_num_pages < rc.num_pages
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 512, 8 * WINDOW)]
    seq = llm.make_sequence(prompt, _greedy(3 * WINDOW))
    llm.submit(seq)
    decoding, prefilling = [], []
    while llm.has_unfinished():
        llm.step()
        if seq.status is not Status.RUNNING:
            continue
        kv.check(llm.scheduler.running)
        held = kv.local_pages_held(seq)
        assert kv.local.capacity - kv.local.num_free == held  # the only request: the pool's use is its own
        (prefilling if seq.prefilling else decoding).append(held)
        # the full layers keep every page (a token still on the device gets its page next step)
        assert len(seq.pages) >= kv.pages_for(seq.length - seq.num_pending)
    assert len(decoding) >= 2 * WINDOW and prefilling
    assert max(decoding) <= WINDOW // PS + 2  # not the 22 pages of its 88 positions
    assert max(prefilling) <= local_pages_per_request(WINDOW, PS, OPTS["token_buckets"][-1])
    assert seq.output_ids == hf_greedy(hf, prompt, 3 * WINDOW)
    _pools_whole(llm)


@pytest.fixture(scope="module")
def pair(gemma):
    return LLM(gemma[0], **OPTS), LLM(gemma[0], enable_prefix_caching=False, **OPTS)


def _both(pair, prompts, n: int):
    on, off = pair
    a = on.generate(prompts, _greedy(n))
    b = off.generate(prompts, _greedy(n))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    return a


def test_prefix_hits_on_a_sliding_model_equal_a_run_without(gemma, pair):
    """A system prompt five windows long, then a batch sharing it (hits on the pages the first
    request left in the tree, while its own local pages were freed), then a conversation whose
    every turn continues the previous prompt and answer."""
    hf = gemma[1]
    rng = np.random.default_rng(1)
    system = [int(x) for x in rng.integers(3, 512, 5 * WINDOW)]
    first = _both(pair, [system + [7, 8, 9]], 16)
    assert first[0].num_cached_prompt_tokens == 0
    prompts = [system + [int(x) for x in rng.integers(3, 512, int(rng.integers(1, 20)))] for _ in range(8)]
    outs = _both(pair, prompts, 20)
    assert all(o.num_cached_prompt_tokens >= len(system) - PS for o in outs[:3])  # those admitted first
    for p, o in zip(prompts[:2], outs):
        assert o.token_ids == hf_greedy(hf, p, 20)
    history = [int(x) for x in rng.integers(3, 512, 30)]
    for turn in range(3):
        out = _both(pair, [history], 12)[0]
        if turn:  # the previous prompt and answer, but the partial last page
            assert out.num_cached_prompt_tokens >= len(history) - 12 - PS - 1
        history = history + out.token_ids + [int(x) for x in rng.integers(3, 512, 5)]
    _pools_whole(pair[0])
    _pools_whole(pair[1])


def test_mistral_every_layer_sliding_is_one_local_pool(tmp_path):
    hf = make_hf_model("mistral", tmp_path, seed=2, sliding_window=WINDOW)
    llm = LLM(tmp_path, **OPTS)
    rc = llm.runner.cfg
    assert 0 < rc.local_num_pages < rc.num_pages
    assert {layer[0].shape[0] for layer in llm.runner.kv} == {rc.local_num_pages}  # no full-size buffer
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(3, 512, n)] for n in (6 * WINDOW, 3 * WINDOW + 3, 5)]
    outs = llm.generate(prompts, _greedy(2 * WINDOW))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 2 * WINDOW)
    _pools_whole(llm)


@pytest.mark.parametrize("slots,budget_pages", [(4, 40), (16, 40), (4, 400)])
def test_pools_sized_from_memory_never_hold_fewer_pages(gemma, slots, budget_pages):
    """kv_cache_memory_bytes of `budget_pages` pages of every layer: the local pool takes at
    most that many pages (its worst case when it fits: each slot's window and next token, 4
    pages of 4, a step's 32 prompt tokens, the dummy), and the full pool what it leaves at the
    full layers' bytes: at least as many pages as one pool of every layer had, within the same
    memory."""
    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.models.model_config import ModelConfig
    from jaxserve.runner import runner_config

    cfg = ModelConfig.from_dir(gemma[0])
    every = runner_config.kv_bytes_per_token("float32", cfg) * PS  # a page of all 6 layers
    opts = {k: v for k, v in OPTS.items() if k not in ("num_pages", "warmup")} | {"max_slots": slots}
    engine = EngineConfig(**opts, dtype="float32", kv_cache_memory_bytes=budget_pages * every)
    rc = runner_config.resolve(cfg, None, engine, weight_bytes=0, max_logprobs=0)
    assert rc.local_num_pages == min(budget_pages, slots * 4 + 32 // PS + 1)
    assert rc.num_pages >= budget_pages
    used = (5 * rc.local_num_pages + rc.num_pages) * every / 6  # 5 local layers, 1 global
    assert used <= budget_pages * every
    assert rc.num_pages > budget_pages or rc.local_num_pages == budget_pages
