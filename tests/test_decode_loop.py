"""Several decode steps in one device call (`num_scheduler_steps`, runner/decode_loop.py).

Oracles: the host's own step batch for the next step (what `advance` must build on the device),
and an engine making one call per step, which every output of a multi-step engine must equal:
tokens, text, finish reasons, logprobs, with EOS, max_tokens, stop strings, min_tokens, logit
bias, seeded sampling, more requests than slots, preemption and the prefix cache in play. Every
page returns to the pool and nothing compiles after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import pool_whole

from jaxserve import LLM, SamplingParams
from jaxserve.runner import decode_loop, step_batch
from jaxserve.runner.step_batch import DUMMY_PAGE, Chunk

PS = 4


def _batch(rows, **kw):
    return step_batch.build(rows, num_rows=8, num_tokens=8, table_width=6, page_size=PS, vocab_size=300, **kw)


def test_advance_builds_what_the_host_builds_one_token_later():
    # rows: mid-page, at a page's last slot (the next token opens a page), at the end of its
    # pages (the next position has none: the dummy page), one at the table's end
    rows = [
        Chunk([5], 6, [3, 4], (0.0, 0, 1.0, 7, 2)),
        Chunk([6], 7, [3, 4, 9], (0.8, 5, 0.9, 1, 0)),
        Chunk([7], 11, [10, 11, 12], (0.0, 0, 1.0, 0, 4)),
        Chunk([8], 23, [1, 2, 5, 6, 7, 8], (0.0, 0, 1.0, 0, 9)),
    ]
    sampled = np.array([40, 41, 42, 43, 0, 0, 0, 0], np.int32)
    got, tokens = jax.jit(decode_loop.advance, static_argnums=2)(_batch(rows), sampled, PS)
    later = [
        Chunk([int(t)], c.start + 1, c.pages, (*c.sampling[:4], c.sampling[4] + 1))
        for c, t in zip(rows, sampled)
    ]  # fmt: skip
    want = _batch(later)
    assert np.array_equal(tokens, want.tokens)
    assert np.array_equal(got.tokens, want.tokens)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "positions"):
        assert np.array_equal(getattr(got.attn, name), getattr(want.attn, name)), name
    assert np.array_equal(got.sampling.counters, want.sampling.counters)
    assert np.array_equal(got.feed, np.full_like(want.feed, -1))
    assert got.attn.slot_mapping[2] == DUMMY_PAGE * PS  # position 12: past its three pages
    assert got.attn.slot_mapping[3] == DUMMY_PAGE * PS  # position 24: past the table


BASE = dict(max_slots=4, page_size=PS, max_model_len=160, num_pages=44, token_buckets=(4, 8, 16, 32))


@pytest.fixture(scope="module")
def engines(tok_model):
    d, _, _ = tok_model
    one = LLM(d, **BASE, num_scheduler_steps=1)
    many = LLM(d, **BASE, num_scheduler_steps=8)
    yield one, many
    one.shutdown()
    many.shutdown()


def _requests(stop: str | None):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, int(rng.integers(3, 30))).tolist() for _ in range(11)]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=3, temperature=0.9, seed=5),
        SamplingParams(max_tokens=60, temperature=0),  # may stop at EOS
        SamplingParams(max_tokens=33, temperature=1.0, top_p=0.8, seed=9, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, min_tokens=10),
        SamplingParams(max_tokens=30, temperature=0, logit_bias={7: 5.0, 9: -100}, ignore_eos=True),
        SamplingParams(max_tokens=50, temperature=0.7, top_k=20, seed=2),
        SamplingParams(max_tokens=45, temperature=0, ignore_eos=True, stop=(stop,) if stop else ()),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=70, temperature=0, ignore_eos=True),
    ]
    return prompts, params


def _key(outs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def test_several_steps_a_call_give_what_one_step_a_call_gives(engines):
    one, many = engines
    prompts, params = _requests(None)
    plain = one.generate(prompts, params)
    text = plain[8].text
    stop = text[len(text) // 2 : len(text) // 2 + 3] or None  # a stop string inside a call's tokens
    prompts, params = _requests(stop)
    want = one.generate(prompts, params)
    calls = many.stats()["multi_step_calls"]
    got = many.generate(prompts, params)
    assert _key(got) == _key(want)
    assert stop is None or want[8].finish_reason == "stop"
    stats = many.stats()
    assert stats["multi_step_calls"] > calls  # calls of several steps ran
    assert stats["preemptions"] > 0  # 44 pages for 4 slots of up to 100 tokens
    assert many.compiles_since_warmup() == 0
    pool_whole(many)


def test_the_prefix_cache_serves_a_multi_step_engine_the_same(engines):
    one, many = engines
    prompts, params = _requests(None)
    shared = prompts[0] * 3
    prompts = [shared + p for p in prompts[:4]]
    want = one.generate(prompts, params[:4])
    hits = many.stats()["prefix_cache_hit_tokens"]
    many.generate(prompts[:1], params[:1])
    got = many.generate(prompts, params[:4])
    assert _key(got) == _key(want)
    assert many.stats()["prefix_cache_hit_tokens"] > hits
    pool_whole(many)


def test_rows_the_host_must_see_decode_a_step_a_call(engines):
    one, many = engines
    prompts, _ = _requests(None)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    want = one.generate(prompts[:3], params)
    calls = many.stats()["multi_step_calls"]
    got = many.generate(prompts[:3], params)
    assert many.stats()["multi_step_calls"] == calls  # logprobs: every token read on the host
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]
    pool_whole(many)


def test_the_decode_loop_lowers_for_tpu(tok_model, monkeypatch):
    """The plain step's program with several decode steps (a while loop around the Pallas ragged
    kernel) exports for TPU: the loop is what serving runs there."""
    from jaxserve.runner import model_runner, sampling

    monkeypatch.setattr(model_runner, "default_argmax", lambda mesh: sampling.argmax)  # the CPU's is a custom call
    d, _, _ = tok_model
    opts = dict(attention_impl="pallas", interpret=False, matmul_impl="xla", num_scheduler_steps=8)
    llm = LLM(d, **{**BASE, "page_size": 16, "num_pages": 32}, **opts, warmup=False)
    r = llm.runner
    batch = r.batch([Chunk([1], 5, [1], step_batch.GREEDY)] * 4, 4, 4)
    exported = jax.export.export(r.target.step.jitted, platforms=("tpu",))(
        r.target.params, r.target.kv, batch, r._prev_tokens, np.bool_(False), None, np.int32(8),
        num_logprobs=r.cfg.max_logprobs, max_steps=8, page_size=16,
    )  # fmt: skip
    text = exported.mlir_module()
    assert "stablehlo.while" in text and "tpu_custom_call" in text
    llm.shutdown()


def test_the_host_decided_greedy_step_gives_what_the_device_decided_one_gives(engines):
    """Off the CPU the host tells the step when every row is greedy without controls (static
    greedy_only: the argmax alone, no sort, noise or penalty pass). Forced on here, over greedy,
    seeded, top-k/top-p, min_tokens and logit-bias rows mixed and alone, in steps of one and of
    several decode steps a call, every output equals the CPU's own path."""
    one, many = engines
    prompts, params = _requests(None)
    want = [one.generate(prompts, params), one.generate(prompts[:4], SamplingParams(max_tokens=20, temperature=0))]
    got = []
    for llm in (one, many):
        llm.runner.greedy_static = True
        try:
            got.append(
                [llm.generate(prompts, params), llm.generate(prompts[:4], SamplingParams(max_tokens=20, temperature=0))]
            )
        finally:
            llm.runner.greedy_static = False
    for g in got:
        assert [_key(o) for o in g] == [_key(o) for o in want]
    pool_whole(one)
    pool_whole(many)
