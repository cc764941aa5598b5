"""Structured output and the sampling controls, end to end on the shipped default model (it was
never trained on JSON: the constraint alone makes the output valid): constrained outputs
validate while unconstrained requests in the same batch are unchanged, penalties equal
transformers, min_tokens, logit_bias, n completions sharing the prompt's pages, exact
logprobs counts, zero compiles after warm-up over a mixed run, and the gRPC mapping.
The 200-request version of the validity check is `jaxserve bench structured --validate 200`."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
from conftest import TEST_MODEL

from jaxserve import LLM, SamplingParams
from jaxserve.engine.client import split_logprobs
from jaxserve.runner.executable_cache import compile_count
from jaxserve.tools.bench import structured as bench

PROMPT = "def parse(data):\n    return "


@pytest.fixture(scope="module")
def llm():
    return LLM(TEST_MODEL, max_slots=8, max_model_len=256, token_buckets=(16, 32, 64), page_size=16)


def _pool_whole(llm):
    llm.flush_prefix_cache()
    llm.allocator.check()
    assert llm.allocator.num_free == llm.allocator.capacity
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_constrained_outputs_validate_and_unconstrained_ones_are_unchanged(llm):
    reqs = bench.mixed_requests(40, seed=1, max_tokens=160)
    kinds = {k for _, _, (k, _) in reqs}
    assert kinds == {"json_schema", "regex", "grammar", None}
    before = compile_count()
    outs = llm.generate([p for p, _, _ in reqs], [sp for _, sp, _ in reqs])
    assert compile_count() == before
    errors = [e for (_, _, (k, s)), o in zip(reqs, outs) if k and (e := bench.check(o, k, s))]
    assert not errors, errors
    plain = [(o, p, sp) for o, (p, sp, (k, _)) in zip(outs, reqs) if k is None]
    assert len(plain) >= 4 and {sp.greedy for _, _, sp in plain} == {True, False}
    for o, p, sp in plain:  # token for token what they are alone
        assert llm.generate([p], sp)[0].token_ids == o.token_ids
    st = llm.stats()
    assert st["grammar_mask_steps"] > 0 and st["grammar_mask_seconds"] > 0
    _pool_whole(llm)


def test_json_object_and_a_cached_schema(llm):
    g = llm.core.grammars
    hits = g.hits
    for _ in range(2):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=200, temperature=0.7, seed=3, json_object=True))[0]
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    assert g.hits >= hits + 1  # compiled once, by its text
    _pool_whole(llm)


@pytest.mark.parametrize(
    "field, value",
    [
        ("json_schema", {"type": "foo"}),
        ("json_schema", {"$ref": "#/$defs/missing"}),
        ("regex", "[a-"),
        ("grammar", "start: undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(llm, field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        llm.generate([PROMPT], SamplingParams(**{field: value}))
    assert not llm.scheduler.waiting and not llm.scheduler.running


def test_repetition_penalty_equals_transformers(llm):
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(llm.model_path), dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=True)
    for penalty in (1.3, 0.9):
        with torch.no_grad():
            ref = hf.generate(  # an explicit mask: BOS (0) must not count as padding
                torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                repetition_penalty=penalty,
                eos_token_id=None,
                pad_token_id=2,
            )[0, len(ids) :].tolist()
        got = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, repetition_penalty=penalty))[0]
        assert got.token_ids == ref, penalty


def test_presence_and_frequency_penalties_change_greedy_output(llm):
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    pen = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=2.0))[
        0
    ].token_ids
    assert pen != plain
    assert max(np.bincount(pen)) <= max(np.bincount(plain))


def test_min_tokens_never_ends_early(llm, monkeypatch):
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    eos, stop = plain[1], plain[3]  # make early greedy tokens the EOS and a stop token
    monkeypatch.setattr(llm.scheduler, "eos", frozenset(llm.scheduler.eos | {eos}))
    early = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop]))[0]
    assert len(early.token_ids) == 2 and early.finish_reason == "stop"
    for seed in range(3):
        params = SamplingParams(max_tokens=30, temperature=0 if seed == 0 else 1.0, seed=seed, min_tokens=12)
        out = llm.generate([PROMPT], params.__class__(**{**params.__dict__, "stop_token_ids": (stop,)}))[0]
        assert len(out.token_ids) >= 12, out.token_ids
        assert not {eos, stop} & set(out.token_ids[:11])
    _pool_whole(llm)


def test_logit_bias_bans_and_favours_tokens(llm):
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].token_ids
    banned = [int(t) for t in set(plain[:4])]
    for temperature in (0, 1.0):
        out = llm.generate(
            [PROMPT],
            SamplingParams(
                max_tokens=20, temperature=temperature, seed=1, ignore_eos=True, logit_bias={t: -100 for t in banned}
            ),
        )[0].token_ids
        assert not set(banned) & set(out)
    fav = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={77: 100.0}))[
        0
    ].token_ids
    assert fav == [77] * 5


def test_n_completions_share_the_prompt_pages(llm):
    prompt = list(range(3, 3 + 90))  # 90 tokens: 5 full pages of 16 and a partial one
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)
    llm.flush_prefix_cache()
    rid = llm.add_request(prompt, params)
    held = set()
    for _ in range(6):
        llm.step()
        seqs = [s for s in llm.scheduler.running if s.parent_id == rid]
        if len(seqs) == 4:
            held = {p for s in seqs for p in s.pages}
            break
    assert len(seqs) == 4
    per_seq = llm.allocator.pages_for(len(prompt) + 1)
    assert len(held) == 5 + 4, held  # the 5 full prompt pages once, then one private page each
    assert len(held) < 4 * per_seq
    assert all(s.num_cached_prompt_tokens == len(prompt) - 1 for s in seqs if s.index > 0)  # prefilled once
    while llm.has_unfinished():
        llm.step()
    a = llm.generate([prompt], params)
    b = llm.generate([prompt], params)
    assert [o.index for o in a] == [0, 1, 2, 3] and all(o.request_id == a[0].request_id for o in a)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # seeded: reproducible
    assert len({tuple(o.token_ids) for o in a}) == 4  # each completion its own seed stream
    _pool_whole(llm)


def test_aborting_a_request_aborts_all_its_completions(llm):
    rid = llm.add_request([5] * 40, SamplingParams(n=3, max_tokens=100, temperature=0.5, ignore_eos=True))
    for _ in range(3):
        llm.step()
    llm.abort(rid)
    outs = [o for o in llm.step() if o.request_id == rid]
    assert sorted(o.index for o in outs) == [0, 1, 2] and {o.finish_reason for o in outs} == {"abort"}
    _pool_whole(llm)


def test_logprobs_n_returns_exactly_n_alternatives(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        chosen, top = split_logprobs(lp, 3)
        assert chosen.token_id == tok and len(top) == 3
        assert tok == top[0].token_id  # greedy: the chosen token is the most likely alternative
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
    chosen, top = split_logprobs({9: -5.0, 1: -0.1, 2: -0.2}, 2)  # a sampled token outside the top 2
    assert chosen.token_id == 9 and [t.token_id for t in top] == [1, 2]


def test_no_compiles_after_warmup_over_a_mixed_run(llm):
    rng = np.random.default_rng(8)
    names = list(bench.SCHEMAS)
    prompts, params = [], []
    for i in range(24):
        kw = dict(max_tokens=int(rng.integers(4, 20)), temperature=float(rng.choice([0, 0.8])), seed=i)
        kind = i % 8
        if kind == 0:
            kw.update(json_schema=bench.SCHEMAS[names[i % len(names)]], max_tokens=160)
        elif kind == 1:
            kw.update(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)
        elif kind == 2:
            kw.update(min_p=0.1, top_k=20)
        elif kind == 3:
            kw.update(min_tokens=3, stop_token_ids=[5])
        elif kind == 4:
            kw.update(logit_bias={7: -100, 11: 3.0})
        elif kind == 5:
            kw.update(n=2)
        elif kind == 6:
            kw.update(logprobs=2, regex=r"[a-z]{1,6}")
        prompts.append([int(x) for x in rng.integers(3, 4000, int(rng.integers(2, 70)))])
        params.append(SamplingParams(**kw))
    before = compile_count()
    outs = llm.generate(prompts, params)
    assert compile_count() == before
    assert len(outs) == 24 + 3 and all(o.finished for o in outs)
    _pool_whole(llm)


def test_grpc_and_http_map_every_new_field(llm):
    import grpc

    from jaxserve.serving.client import Client
    from jaxserve.serving.server import Server
    from jaxserve.v1 import jaxserve_pb2 as pb

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = Server(llm, port=0, http_port=0)
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        c = Client(f"127.0.0.1:{port}")
        sampling = pb.SamplingParams(
            max_tokens=160,
            temperature=0.7,
            seed=5,
            n=2,
            json_schema=json.dumps(bench.SCHEMAS["order"]),
            logit_bias={7: -100.0},
            min_p=0.05,
            repetition_penalty=1.1,
            logprobs=2,
        )
        texts, done = {0: "", 1: ""}, set()
        for r in c.stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sampling), timeout=120):
            texts[r.index] += r.text
            assert all(len(lp.top) == 2 for lp in r.logprobs)
            if r.finish_reason:
                done.add(r.index)
        assert done == {0, 1}
        for t in texts.values():
            assert json.loads(t)["qty"] in range(1, 11), t
        for bad, field in [
            (pb.SamplingParams(temperature=float("nan")), "temperature"),
            (pb.SamplingParams(regex="[a-"), "regex"),
            (pb.SamplingParams(presence_penalty=float("inf")), "presence_penalty"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                list(c.stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=bad), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        _openai_fields(f"http://127.0.0.1:{server.http_port}/v1", server.http.model_name)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    _pool_whole(llm)


def _openai_fields(base_url: str, model: str) -> None:
    """The OpenAI-compatible API: response_format json_schema, n, logit_bias, penalties, min_p."""
    import openai

    c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    schema = bench.SCHEMAS["segment"]
    common = dict(
        model=model,
        messages=[{"role": "user", "content": "Two points, please."}],
        max_tokens=160,
        n=2,
        seed=7,
        temperature=0.8,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        logit_bias={"7": -100},
        extra_body={"min_p": 0.05},
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "segment", "schema": schema}}
    r = c.chat.completions.create(response_format=fmt, **common)
    assert [ch.index for ch in r.choices] == [0, 1]
    import jsonschema

    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), schema)
    streamed = {0: "", 1: ""}
    for chunk in c.chat.completions.create(response_format={"type": "json_object"}, stream=True, **common):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert all(isinstance(json.loads(t), dict) for t in streamed.values()), streamed
