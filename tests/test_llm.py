"""The engine end to end: continuous batching against transformers run alone, preemption,
seeded sampling, page accounting, zero compiles after warm-up, and input validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from jaxserve import LLM, SamplingParams
from jaxserve.runner.executable_cache import compile_count

GREEDY = dict(temperature=0, ignore_eos=True)


def _mixed_requests(n: int, vocab: int, seed: int, max_prompt=90, max_out=40):
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(3, vocab, int(rng.integers(1, max_prompt)))] for _ in range(n)]
    outs = [int(rng.integers(1, max_out)) for _ in range(n)]
    return prompts, outs


def _assert_pool_whole(llm: LLM):
    llm.flush_prefix_cache()
    llm.allocator.check()
    assert llm.allocator.num_free == llm.allocator.capacity, "pages leaked"
    assert not llm.scheduler.running and not llm.scheduler.waiting


@pytest.fixture(scope="module")
def llm(tok_model):
    return LLM(tok_model[0], max_slots=8, page_size=8, max_model_len=160, num_pages=160, token_buckets=(16, 32, 64))


# 8 slots but only 24 pages of 8 tokens: requests growing to ~100 tokens must preempt.
SMALL_POOL = dict(max_slots=8, page_size=8, max_model_len=160, num_pages=24, token_buckets=(16, 32, 64))
INT8 = dict(quantization="int8", kv_cache_dtype="int8")  # int8 weights and int8 KV pages (issue #19)


@pytest.fixture(scope="module")
def small_pool(tok_model):
    """Engines on the small pool, built on first use and shared by the tests below:
    small_pool(weights, async_scheduling). weights "int8": int8 weights and int8 KV pages,
    whose oracle is the same quantized model (run alone, or scheduled synchronously)."""
    built = {}

    def get(weights: str, on: bool = True) -> LLM:
        if (weights, on) not in built:
            quant = INT8 if weights == "int8" else {}
            built[weights, on] = LLM(tok_model[0], async_scheduling=on, **SMALL_POOL, **quant)
        return built[weights, on]

    return get


@pytest.fixture(params=["float32", "int8"])
def engine(request):
    """The module's engine, and the int8 one (on the small pool: it also preempts)."""
    if request.param == "int8":
        return request.getfixturevalue("small_pool")("int8")
    return request.getfixturevalue("llm")


def test_greedy_batch_equals_transformers_alone(llm, tok_model):
    hf = tok_model[1]
    prompts, outs = _mixed_requests(24, 512, seed=0)
    results = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in outs])
    for p, m, r in zip(prompts, outs, results):
        assert r.token_ids == hf_greedy(hf, p, m)
        assert r.finish_reason == "length"
    _assert_pool_whole(llm)


def test_preemption_keeps_greedy_outputs(tok_model, small_pool):
    hf = tok_model[1]
    small = small_pool("float32")
    prompts, outs = _mixed_requests(12, 512, seed=1, max_prompt=60, max_out=60)
    before, preempted = compile_count(), small.scheduler.num_preemptions
    results = small.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in outs])
    assert small.scheduler.num_preemptions > preempted
    assert compile_count() == before
    for p, m, r in zip(prompts, outs, results):
        assert r.token_ids == hf_greedy(hf, p, m)
    _assert_pool_whole(small)


def test_capped_prompt_chunks_keep_greedy_outputs(llm, tok_model):
    """`max_prefill_tokens_while_decoding` (8 here) cuts prompts into small chunks while others
    decode, served shortest first: outputs still equal transformers', nothing compiles, every
    page comes back."""
    hf = tok_model[1]
    prompts, outs = _mixed_requests(12, 512, seed=2, max_prompt=60, max_out=30)
    before = compile_count()
    llm.scheduler.max_prefill_tokens_while_decoding = 8
    try:
        results = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in outs])
    finally:
        llm.scheduler.max_prefill_tokens_while_decoding = None
    assert compile_count() == before
    for p, m, r in zip(prompts, outs, results):
        assert r.token_ids == hf_greedy(hf, p, m)
    _assert_pool_whole(llm)


def test_int8_preemption_keeps_greedy_outputs_and_every_page(small_pool):
    """The same with int8 weights and int8 KV pages: preempted and batched greedy outputs equal
    each request run alone on the same quantized engine (prefix cache flushed, so alone is a
    fresh computation); nothing compiles; every page comes back."""
    small = small_pool("int8")
    assert small.runner.target.kv[0][0].dtype == np.int8
    prompts, outs = _mixed_requests(12, 512, seed=1, max_prompt=60, max_out=60)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in outs]
    before, preempted = compile_count(), small.scheduler.num_preemptions
    results = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > preempted
    _assert_pool_whole(small)
    for p, sp, r in zip(prompts, params, results):
        assert len(r.token_ids) == sp.max_tokens
        small.flush_prefix_cache()
        assert small.generate([p], sp)[0].token_ids == r.token_ids
    assert compile_count() == before
    _assert_pool_whole(small)


def test_seeded_sampling_is_batch_independent(llm):
    prompt = [5, 17, 99, 3, 42]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    others, outs = _mixed_requests(7, 512, seed=2)
    batch = llm.generate(
        [others[0], prompt] + others[1:],
        [SamplingParams(max_tokens=o, temperature=1.0, ignore_eos=True) for o in outs[:1]]
        + [params]
        + [SamplingParams(max_tokens=o, **GREEDY) for o in outs[1:]],
    )
    assert batch[1].token_ids == alone
    other_seed = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=99, ignore_eos=True)
    )[0].token_ids
    assert other_seed != alone  # the seed matters
    _assert_pool_whole(llm)


def test_abort_frees_pages_within_one_step(engine):
    llm = engine
    ids = [llm.add_request([7] * 30, SamplingParams(max_tokens=100, **GREEDY)) for _ in range(5)]
    for _ in range(3):
        llm.step()
    assert llm.allocator.num_free < llm.allocator.capacity
    llm.abort(ids[0])
    llm.abort(ids[3])
    outs = llm.step()
    aborted = {o.request_id for o in outs if o.finish_reason == "abort"}
    assert aborted == {ids[0], ids[3]}
    held = {p for s in llm.scheduler.running for p in s.pages} | set(llm.prefix_cache.pages())
    assert llm.allocator.num_free == llm.allocator.capacity - len(held)
    for rid in ids[1:3] + ids[4:]:
        llm.abort(rid)
    llm.step()
    _assert_pool_whole(llm)


def test_no_compiles_after_warmup_over_100_mixed_requests(engine):
    llm = engine
    prompts, outs = _mixed_requests(100, 512, seed=3, max_prompt=120, max_out=30)
    rng = np.random.default_rng(4)
    params = []
    for m in outs:
        kind = rng.integers(0, 3)
        if kind == 0:
            params.append(SamplingParams(max_tokens=m, **GREEDY))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=m, temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 30))))
        else:
            params.append(SamplingParams(max_tokens=m, temperature=0, logprobs=3))
    before = compile_count()  # process-wide: other tests' engines compile too, so take the difference
    results = llm.generate(prompts, params)
    assert compile_count() - before == 0
    assert all(r.finished for r in results)
    _assert_pool_whole(llm)


def test_logprobs_match_transformers(llm, tok_model):
    hf = tok_model[1]
    prompt = [4, 8, 15, 16, 23, 42]
    r = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=4, ignore_eos=True))[0]
    assert len(r.logprobs) == 5
    ids = prompt + r.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    for i, (tok, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert len(lp) >= 4 and tok in lp
        for t, v in lp.items():
            assert abs(v - row[t]) < 1e-4
        assert set(np.argsort(-row)[:4]) <= set(lp)


def test_text_prompt_stream_and_stop_strings(llm, tok_model):
    tok = tok_model[2]
    prompt = "def f(x):"
    full = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    pieces = list(llm.stream(prompt, SamplingParams(max_tokens=30, **GREEDY)))
    assert "".join(p.text for p in pieces) == full.text
    assert sum(len(p.token_ids) for p in pieces) == 30 and pieces[-1].finish_reason == "length"
    # A stop string taken from the middle of the greedy text: output ends right before it.
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop and stop in full.text
    streamed = list(llm.stream(prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY)))
    text = "".join(p.text for p in streamed)
    assert text == full.text[: full.text.find(stop)]
    assert streamed[-1].finish_reason == "stop"
    sent = ""
    for p in streamed:  # never a partial stop string on the wire
        sent += p.text
        assert stop not in sent
    # A stop token id finishes with "stop" and includes the token.
    tid = full.token_ids[5]
    r = llm.generate([prompt], SamplingParams(max_tokens=30, stop_token_ids=[tid], **GREEDY))[0]
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    _assert_pool_whole(llm)


def test_deferred_text_is_the_streamed_text_however_it_is_read(llm, tok_model):
    """A request without stop strings is not detokenized on the engine thread: each output's
    text is decoded when first read. Read in order, in reverse, or only the last one (the
    others dropped unread), the text is the same as the streamed text, which is the
    tokenizer's decode of the tokens (sampled tokens include bytes of multi-byte characters)."""
    tok = tok_model[2]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    prompt = "hello world, héllo wörld ☃ 日本語"
    ids = [llm.add_request(prompt, params) for _ in range(3)]
    outs: dict[str, list] = {rid: [] for rid in ids}
    while llm.has_unfinished():
        for out in llm.step():
            outs[out.request_id].append(out)
    in_order, backwards, last_only = (outs[rid] for rid in ids)
    streamed = "".join(o.text for o in in_order)
    tokens = [t for o in in_order for t in o.token_ids]
    assert streamed == tok.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    assert [o.token_ids for o in backwards] == [o.token_ids for o in in_order]  # same seed
    texts = [o.text for o in reversed(backwards)][::-1]
    assert "".join(texts) == streamed and len(texts) == len(in_order)
    final = last_only[-1]
    del last_only[:-1], outs  # the earlier outputs are dropped unread: their text goes to the last
    assert final.text == streamed and final.finished
    _assert_pool_whole(llm)


def test_eos_finishes_unless_ignored(llm, tok_model, monkeypatch):
    hf = tok_model[1]
    prompt = [9, 10, 11]
    ref = hf_greedy(hf, prompt, 40)
    eos = ref[7]  # make the 8th greedy token the end-of-sequence token (the random model rarely emits id 1)
    first = ref.index(eos)
    monkeypatch.setattr(llm.scheduler, "eos", frozenset({eos}))
    r = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert r.token_ids == ref[: first + 1] and r.finish_reason == "stop"
    r = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert r.token_ids == ref and r.finish_reason == "length"
    _assert_pool_whole(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[1, 2, 600]), "prompt_token_ids"),
        (dict(prompt=[1, 2], params=dict(max_tokens=200)), "max_tokens"),
        (dict(prompt=[1], params=dict(temperature=-0.5)), "temperature"),
        (dict(prompt=[1], params=dict(top_p=0.0)), "top_p"),
        (dict(prompt=[1], params=dict(top_p=1.5)), "top_p"),
        (dict(prompt=[1], params=dict(top_k=-2)), "top_k"),
        (dict(prompt=[1], params=dict(max_tokens=0)), "max_tokens"),
    ],
)
def test_bad_input_names_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        params = SamplingParams(**kwargs.get("params", {}))
        llm.generate([kwargs["prompt"]], params)
    assert not llm.scheduler.waiting and not llm.scheduler.running


@pytest.mark.parametrize(
    "prompts, field",
    [
        ([{"role": "user", "content": "hi"}], "use LLM.chat"),
        ([[{"role": "user", "content": "hi"}]], "use LLM.chat"),
        ([[1.9, 2.2]], "prompt_token_ids"),
        ([["1", "2"]], "prompt_token_ids"),
        ([[1, True]], "prompt_token_ids"),
        ([None], "prompt"),
        ([7.0], "prompt"),
        (7, "prompt"),
        ([np.array([1.0, 2.0])], "prompt_token_ids"),
        ([np.array([[1, 2]])], "prompt_token_ids"),
    ],
)
def test_wrong_type_prompts_name_the_field(llm, prompts, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, SamplingParams(max_tokens=1))
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=1))[0].prompt_token_ids == [5, 6]  # still serving


def test_numpy_integer_prompts(llm):
    sp = SamplingParams(max_tokens=2, **GREEDY)
    want = llm.generate([[5, 6, 7]], sp)[0].token_ids
    arr = np.array([5, 6, 7], dtype=np.int32)
    for prompt in (arr, list(arr), [arr]):
        outs = llm.generate(prompt, sp)
        assert [(o.prompt_token_ids, o.token_ids) for o in outs] == [([5, 6, 7], want)]
    _assert_pool_whole(llm)


def test_closing_a_stream_early_aborts_its_request(engine):
    llm = engine
    g = llm.stream([7] * 20, SamplingParams(max_tokens=80, n=2, **GREEDY))
    next(g)
    assert llm.has_unfinished()
    g.close()
    assert not llm.has_unfinished()
    _assert_pool_whole(llm)


def test_a_failing_step_aborts_the_generate_calls_requests(llm, monkeypatch):
    real, calls = llm.core.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(llm.core, "step", step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[7] * 20, [8] * 9], SamplingParams(max_tokens=80, **GREEDY))
    assert not llm.has_unfinished()
    _assert_pool_whole(llm)


def test_chat_takes_a_conversation(llm, monkeypatch):
    from jaxserve.engine.chat import Conversation

    monkeypatch.setattr(llm.core, "render_chat", lambda conversation: [5, 6, 7])
    out = llm.chat(Conversation.of([{"role": "user", "content": "hi"}]), SamplingParams(max_tokens=1))
    assert [o.prompt_token_ids for o in out] == [[5, 6, 7]]


def test_refuses_a_pool_that_cannot_hold_one_request(tok_model):
    with pytest.raises(ValueError, match=r"KV cache too small.*max_model_len=160.*20 pages.*pool has 10"):
        LLM(tok_model[0], max_slots=2, page_size=8, max_model_len=160, num_pages=10, warmup=False)


def test_direct_tokenizer_is_the_one_autotokenizer_builds(tok_model, tmp_path):
    """load_tokenizer skips AutoTokenizer for generic fast tokenizers (start-up time): it must
    build the same tokenizer, and any model-specific class must still go through AutoTokenizer."""
    import shutil

    from conftest import TEST_MODEL
    from transformers import AutoTokenizer

    from jaxserve.engine.tokenizer import load_tokenizer

    texts = ["def f(x):\n    return x + 1\n", "héllo wörld ☃ 日本語 <s> </s>", "", "  spaces\ttabs\n\n"]
    for path in (tok_model[0], TEST_MODEL):
        ours, auto = load_tokenizer(Path(path)), AutoTokenizer.from_pretrained(str(path))
        assert type(ours) is type(auto)
        assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
            auto.bos_token_id,
            auto.eos_token_id,
            auto.pad_token_id,
            auto.all_special_ids,
        )
        for t in texts:
            ids = ours.encode(t, add_special_tokens=True)
            assert ids == auto.encode(t, add_special_tokens=True)
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    other = tmp_path / "gpt2-tok"
    shutil.copytree(TEST_MODEL, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(load_tokenizer(other)).__name__ == "GPT2Tokenizer"


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_async_scheduling_changes_no_output(small_pool, monkeypatch, weights):
    """Dispatching each decode step before reading the previous one's tokens must not change
    a single output: stops found a step late drop their extra token, preemption (a 24-page
    pool) and n > 1 still work, and every page comes back. Against the same engine run with
    async_scheduling=False, over greedy, seeded, logprob, penalized, min_tokens and stop rows;
    also with int8 weights and int8 KV pages (both engines quantized)."""
    engines = {on: small_pool(weights, on) for on in (True, False)}
    preempted = {on: llm.scheduler.num_preemptions for on, llm in engines.items()}
    overlapped = {on: llm.core.overlapped_steps for on, llm in engines.items()}
    prompts, outs = _mixed_requests(20, 512, seed=5, max_prompt=60, max_out=50)
    rng = np.random.default_rng(6)
    params = []
    for i, m in enumerate(outs):
        kind = i % 6
        extra = dict(stop_token_ids=[int(x) for x in rng.integers(3, 512, 3)]) if i % 4 == 0 else {}
        if kind == 0:
            params.append(SamplingParams(max_tokens=m, temperature=0, **extra))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=m, temperature=0.9, top_p=0.9, seed=i, **extra))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=m, temperature=0, logprobs=2, **extra))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=m, temperature=0.7, seed=i, n=2, **extra))
        elif kind == 4:
            params.append(SamplingParams(max_tokens=m, temperature=0, repetition_penalty=1.3, **extra))
        else:
            params.append(SamplingParams(max_tokens=m, temperature=0.8, seed=i, min_tokens=min(m, 5), **extra))
    # Some rows stop on EOS: ids 1, 7, 300 and the 10th greedy token of prompt 2 (a greedy row),
    # which this model (float32 or int8) does emit.
    probe = engines[False].generate([prompts[2]], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    engines[False].flush_prefix_cache()  # both engines start from an empty cache
    eos = frozenset({1, 7, 300, probe[-1]})
    results = {}
    for on, llm in engines.items():
        monkeypatch.setattr(llm.scheduler, "eos", eos)
        results[on] = llm.generate(prompts, params)
        assert llm.scheduler.num_preemptions > preempted[on]
        _assert_pool_whole(llm)
    assert engines[True].core.overlapped_steps > overlapped[True]
    assert engines[False].core.overlapped_steps == overlapped[False] == 0
    assert len(results[True]) == len(prompts) + sum(p.n > 1 for p in params)
    for a, b in zip(results[True], results[False]):
        assert (a.index, a.token_ids, a.finish_reason) == (b.index, b.token_ids, b.finish_reason)
        if a.logprobs is not None:  # batches differ between the two schedules: float noise only
            assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
            assert np.allclose(
                [v for x in a.logprobs for v in x.values()], [v for x in b.logprobs for v in x.values()], atol=1e-4
            )
    assert {r.finish_reason for r in results[True]} == {"stop", "length"}
