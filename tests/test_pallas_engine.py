"""The engine on the Pallas ragged paged attention kernel (interpret mode on the CPU) gives the
same greedy tokens as on the XLA attention, through every step kind (fresh prompts, chunked
prefill, prefix-cache hits and decode: rows of one ragged step). head_dim is 16 here, so this
also covers head dims far below a TPU lane width."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)
# Small on purpose: warm-up compiles every bucket with the interpreted kernels inlined.
ENGINE = dict(max_slots=4, page_size=8, max_model_len=64, num_pages=64, token_buckets=(16, 32))
# Engines whose compiles nobody counts (the XLA references, the speculative one) skip warm-up:
# they compile only the shapes their workload runs.
COLD = dict(warmup=False)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    shared = [int(x) for x in rng.integers(3, 512, 20)]
    lengths = (5, 13, 40)  # 40 > the largest bucket: chunked prefill runs a "context" step
    prompts = [[int(x) for x in rng.integers(3, 512, n)] for n in lengths]
    # Two prompts sharing 20 tokens: the second hits the prefix cache (two whole pages).
    return prompts + [shared + [5, 6, 7], shared + [9, 10, 11, 12]]


def _greedy(llm, prompts, params) -> list[list[int]]:
    """All prompts but the last in one batch, then the last (a prefix-cache hit on the one before)."""
    got = [r.token_ids for r in llm.generate(prompts[:-1], params)]
    return got + [r.token_ids for r in llm.generate(prompts[-1:], params)]


@pytest.fixture(scope="module")
def xla_greedy(tok_model) -> list[list[int]]:
    """The XLA path's greedy tokens for _prompts(), the reference of the tests below."""
    params = SamplingParams(max_tokens=8, **GREEDY)
    return _greedy(LLM(tok_model[0], attention_impl="xla", **ENGINE, **COLD), _prompts(), params)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_pallas_engine_matches_xla_greedy(tok_model, xla_greedy, backend, monkeypatch):
    import pallas_kernels.lowering as lowering
    import pallas_kernels.ragged_paged_attention as rpa

    # The kernels pick their lowering from jax.default_backend(); force each in turn.
    monkeypatch.setattr(lowering, "default_backend", lambda: backend)
    traced = []
    real = rpa.ragged_paged_attention

    def spy(*args, **kw):  # runs at trace time: every compiled step's attention went through Pallas
        traced.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(rpa, "ragged_paged_attention", spy)
    want = xla_greedy
    pallas = LLM(tok_model[0], attention_impl="pallas", interpret=True, **ENGINE)
    assert pallas.runner.attention_impl == "pallas"
    got = _greedy(pallas, _prompts(), SamplingParams(max_tokens=8, **GREEDY))  # the last: a prefix hit
    assert got == want
    assert pallas.prefix_cache.hit_tokens > 0, "the prefix-hit path was not exercised"
    assert pallas.compiles_since_warmup() == 0
    # every token bucket's step (one decode row, chunks, chunks with decode rows) ran the kernel
    assert set(traced) >= set(pallas.runner.token_buckets)


def test_pallas_speculative_verify_matches_xla(tok_model):
    """Prompt-lookup speculative decoding verifies k+1 tokens per slot in one step over all
    slots (ragged rows of k + 1 tokens, per-token positions): same greedy tokens as XLA."""
    d = tok_model[0]
    rng = np.random.default_rng(3)
    motif = [int(x) for x in rng.integers(3, 512, 6)]
    prompts = [motif * 4, [int(x) for x in rng.integers(3, 512, 11)] + motif * 2]  # repeats: n-gram hits
    params = SamplingParams(max_tokens=10, **GREEDY)
    spec = dict(ENGINE, speculative_model="ngram", num_speculative_tokens=3)
    want = [r.token_ids for r in LLM(d, attention_impl="xla", **ENGINE, **COLD).generate(prompts, params)]
    pallas = LLM(d, attention_impl="pallas", interpret=True, **spec, **COLD)
    got = [r.token_ids for r in pallas.generate(prompts, params)]
    assert got == want
    assert pallas.spec_stats.steps > 0, "no verification step ran"


def test_cudnn_engine_matches_xla_greedy(tok_model, xla_greedy, monkeypatch):
    """attention_impl="cudnn" (fresh prompts through the dense fused attention, XLA standing in
    for cuDNN on the CPU; chunks after a cached prefix, prefix hits and decode through the
    interpreted Pallas kernel) gives the XLA path's greedy tokens, with no compile after warm-up."""
    from pallas_kernels import prompt_attention

    traced = []
    real = prompt_attention.dense

    def spy(q, *args, **kw):  # trace time: the steps that carry fresh prompts went through it
        traced.append(kw["implementation"])
        return real(q, *args, **kw)

    monkeypatch.setattr(prompt_attention, "dense", spy)
    want = xla_greedy
    hybrid = LLM(tok_model[0], attention_impl="cudnn", interpret=True, **ENGINE)
    assert hybrid.runner.attention_impl == "cudnn"
    got = _greedy(hybrid, _prompts(), SamplingParams(max_tokens=8, **GREEDY))
    assert got == want
    assert hybrid.prefix_cache.hit_tokens > 0, "the prefix-hit path was not exercised"
    assert hybrid.compiles_since_warmup() == 0
    assert traced and set(traced) == {"xla"}
