"""Speculative decoding: greedy outputs identical to plain decoding (draft model and prompt
lookup, with preemption), and sampling that is lossless under a chi-square test that also
rejects a deliberately wrong acceptance rule."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from conftest import SMOLLM2_WIDTHS, TEST_MODEL, bf16_isas, cpu_isa, make_hf_model
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.engine.spec_policy import StepCosts
from jaxserve.runner import speculative
from jaxserve.runner.executable_cache import compile_count

# Speculative engines here speculate at every batch (the CPU default runs steps with more than
# 16 // (k + 1) decoding sequences plain: test_speculation_off_above_a_batch_size).
OPTS = dict(
    max_slots=6, page_size=8, max_model_len=160, token_buckets=(16, 32, 64), speculative_disable_by_batch_size=6
)
# Only test_greedy_equals_plain_decoding counts compiles (its speculative engine is warmed up);
# every other engine here skips warm-up and compiles just the shapes its workload runs (most of
# a warm-up is sampling and batch-size variants these tests never use).
COLD = dict(warmup=False)


def test_ngram_propose():
    assert speculative.ngram_propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert speculative.ngram_propose([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # most recent match wins
    assert speculative.ngram_propose([1, 2, 3, 4], 3) == []
    assert speculative.ngram_propose([1, 2, 3, 9, 5, 3], 2) == [9, 5]  # a 1-token match
    assert speculative.ngram_propose([1, 2, 3, 9, 5, 3], 2, max_n=3, min_n=2) == []


def test_prompt_lookup_lengths(tok_model, plain):
    """prompt_lookup_min/max reach the proposer: a 3-token minimum proposes less often than 1
    (the output is plain decoding's either way), and a max below the min is refused."""
    prompts, params = _workload(4, repetitive=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    proposed = {}
    for lo in (1, 3):
        llm = LLM(
            tok_model[0],
            speculative_model="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=lo,
            speculative_adaptive=False,  # every proposal is verified (adaptive: test_adaptive_*)
            num_pages=200,
            **OPTS,
            **COLD,
        )
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        proposed[lo] = llm.core.spec_stats.proposed[0]
    assert 0 < proposed[3] < proposed[1]
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        LLM(tok_model[0], speculative_model="ngram", prompt_lookup_min=3, prompt_lookup_max=2, warmup=False)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    make_hf_model("llama", d, seed=7, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return d


def make_eagle_head(target, path, seed: int, draft_vocab: int | None = None, std: float = 0.02):
    """A random EAGLE head for `target` (models/eagle.py) saved to `path`: its draft vocabulary
    a random subset of the target's (all of it when draft_vocab is None). Any head is
    lossless; a random one exercises both outcomes of the acceptance rule."""
    from flax import nnx

    from jaxserve.models import eagle
    from jaxserve.models.loader import read_config

    cfg = read_config(target)
    n = draft_vocab or cfg.vocab_size
    head = eagle.EagleHead(eagle.EagleConfig.for_target(cfg, n), rngs=nnx.Rngs(seed), init_std=std)
    rng = np.random.default_rng(seed)
    head.d2t[...] = np.sort(rng.choice(cfg.vocab_size, n, replace=False)).astype(np.int32)
    eagle.save_head(head, path)
    return path


@pytest.fixture(scope="module")
def eagle_dir(tok_model, tmp_path_factory):
    return make_eagle_head(tok_model[0], tmp_path_factory.mktemp("eagle"), seed=5, draft_vocab=200, std=0.3)


def _workload(seed, n=10, repetitive=False):
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        base = [int(x) for x in rng.integers(3, 500, int(rng.integers(3, 30)))]
        prompts.append(base * 3 if repetitive else base)
    outs = [int(x) for x in rng.integers(5, 40, n)]
    return prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outs]


@pytest.fixture(scope="module")
def plain(tok_model):
    return LLM(tok_model[0], num_pages=200, **OPTS, **COLD)


INT8 = dict(quantization="int8", kv_cache_dtype="int8")  # int8 weights and int8 KV pages (issue #19)


@pytest.fixture(scope="module")
def plain_int8(tok_model):
    return LLM(tok_model[0], num_pages=200, **OPTS, **INT8, **COLD)


@pytest.mark.parametrize(
    "spec, int8",
    [
        pytest.param("draft", False, id="draft"),
        pytest.param("self", False, id="self"),
        pytest.param("ngram", False, id="ngram"),
        pytest.param("eagle", False, id="eagle"),
        # target and draft both int8 (weights and KV pages), against the same int8 target alone
        pytest.param("draft", True, id="draft-int8"),
    ],
)
def test_greedy_equals_plain_decoding(tok_model, draft_dir, eagle_dir, request, spec, int8):
    plain = request.getfixturevalue("plain_int8" if int8 else "plain")
    model = {"draft": str(draft_dir), "self": str(tok_model[0]), "ngram": "ngram", "eagle": str(eagle_dir)}[spec]
    llm = LLM(
        tok_model[0], speculative_model=model, num_speculative_tokens=3, num_pages=200, **OPTS, **(INT8 if int8 else {})
    )
    if int8:
        for w in llm.runner.models + plain.runner.models:
            assert w.state["layers"][0]["mlp"]["down_proj"]["packed"].get_value().dtype == np.int8  # CPU panels
            assert w.kv[0][0].dtype == np.int8
        assert llm.runner.draft is not None
    # The third round repeats the first: every prompt is a full prefix-cache hit and goes
    # straight to decoding, which must still own pages for its k lookahead positions.
    for repetitive in (False, True, False):
        prompts, params = _workload(1, repetitive=repetitive)
        before = compile_count()
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert compile_count() == before
        assert got == [o.token_ids for o in plain.generate(prompts, params)]
    st = llm.stats()
    assert st["spec_target_steps"] > 0
    if spec == "self":  # a draft equal to the target is always right: k+1 tokens per step
        assert st["spec_mean_accepted"] > 3.0
    llm.flush_prefix_cache()
    assert llm.allocator.num_free == llm.allocator.capacity


@pytest.fixture
def bf16_host():
    """The host's bfloat16 matmul switched on for one test (the suite runs with it off: conftest
    sets JAXSERVE_CPU_ISA=avx512), back off after it: engines built later get float32."""
    isas = bf16_isas()
    if not isas:
        pytest.skip("this host has neither AVX512-BF16 nor AMX")
    with cpu_isa(isas[-1]) as got:
        yield got


def test_greedy_equals_plain_decoding_in_bfloat16(bf16_host, tmp_path):
    """With bfloat16 weights and KV pages (the default on such a host) prompt lookup's greedy
    output is still plain decoding's, token for token. A bfloat16 matmul rounds its input to an
    8-bit mantissa, so a last-bit difference between a token's activations in a verify row
    and in a decode step became a 0.4% one; before the norm summed in a fixed order
    (llama.mean_square) this workload diverged (SmolLM2's widths: hidden 576, 9 heads)."""
    make_hf_model("llama", tmp_path, **SMOLLM2_WIDTHS, num_hidden_layers=4, initializer_range=0.05)
    opts = dict(max_slots=4, page_size=16, max_model_len=256, num_pages=80, token_buckets=(1, 8, 16, 64), **COLD)
    plain = LLM(tmp_path, **opts)
    assert plain.runner.cfg.matmul_dtype == "bfloat16"
    ngram = LLM(tmp_path, speculative_model="ngram", num_speculative_tokens=3, speculative_adaptive=False, **opts)
    prompts, params = _workload(3, n=8, repetitive=True)
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * len(prompts)
    for p in prompts:  # one at a time: batch 1, where a verify row and a decode step differ most
        want = plain.generate([p], params[:1])[0].token_ids
        assert ngram.generate([p], params[:1])[0].token_ids == want
    assert ngram.stats()["spec_target_steps"] > 0


def test_greedy_with_preemption(tok_model, draft_dir, plain):
    llm = LLM(tok_model[0], speculative_model=str(draft_dir), num_speculative_tokens=4, num_pages=30, **OPTS, **COLD)
    prompts, params = _workload(2, n=12)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.scheduler.num_preemptions > 0
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    llm.flush_prefix_cache()
    assert llm.allocator.num_free == llm.allocator.capacity


@pytest.mark.parametrize("spec", ["ngram", "self", "eagle"])
def test_speculation_off_above_a_batch_size(tok_model, eagle_dir, plain, spec):
    """speculative_disable_by_batch_size: a step with more decoding sequences runs plain, one
    with fewer speculates, in the same engine and the same requests; greedy output is plain
    decoding's either way and every page comes back. Those plain steps overlap (async
    scheduling: each dispatched before the last one's tokens are read; a draft fills its KV
    with the fed tokens, so a draft equal to the target is still always right). On the CPU the
    default is 16 // (k + 1)."""
    model = {"ngram": "ngram", "self": str(tok_model[0]), "eagle": str(eagle_dir)}[spec]
    if spec == "ngram":
        for adaptive, default in ((False, 4), (True, None)):  # adaptive lookup decides by batch itself
            llm = LLM(
                tok_model[0],
                speculative_model=model,
                num_speculative_tokens=3,
                max_slots=6,
                speculative_adaptive=adaptive,
                warmup=False,
            )
            assert llm.runner.cfg.speculative_disable_by_batch_size == default
        with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
            LLM(tok_model[0], speculative_model=model, speculative_disable_by_batch_size=0, warmup=False)
    opts = {**OPTS, "speculative_disable_by_batch_size": 2, "speculative_adaptive": False}
    llm = LLM(tok_model[0], speculative_model=model, num_speculative_tokens=3, num_pages=200, **opts, **COLD)
    prompts, params = _workload(4, repetitive=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    st = llm.stats()
    assert st["spec_plain_steps"] > 0 and st["spec_target_steps"] > 0
    assert st["overlapped_steps"] > 0
    if spec == "self":  # its KV filled right in the overlapped steps: k + 1 tokens a step
        assert st["spec_mean_accepted"] > 3.0
    llm.flush_prefix_cache()
    assert llm.allocator.num_free == llm.allocator.capacity


def test_seeded_sampling_reproducible_with_speculation(tok_model, draft_dir):
    llm = LLM(tok_model[0], speculative_model=str(draft_dir), num_speculative_tokens=3, num_pages=200, **OPTS, **COLD)
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], p)[0].token_ids
    crowd = llm.generate(
        [[1, 2], [9, 8, 7], [4, 4, 4, 4]],
        [SamplingParams(max_tokens=30, temperature=1.0), p, SamplingParams(max_tokens=9, temperature=0)],
    )
    assert crowd[1].token_ids == alone


# -- lossless sampling --------------------------------------------------------------------

V = 12
N = 3000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    t = tmp_path_factory.mktemp("tiny_target")
    d = tmp_path_factory.mktemp("tiny_draft")
    common = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.6,
        eos_token_id=None,
        bos_token_id=None,
    )
    hf = make_hf_model("llama", t, seed=3, **common)
    make_hf_model("llama", d, seed=4, **common)
    return t, d, hf


def _exact_two_token_probs(hf, prompt, temperature):
    """P(t1, t2) of plain sampling, from transformers."""
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1).numpy().astype(np.float64)
        ctx = torch.tensor([prompt + [t] for t in range(V)])
        p2 = torch.softmax(hf(ctx).logits[:, -1] / temperature, -1).numpy().astype(np.float64)
    return p1[:, None] * p2


def _sampled_pairs(llm, prompt, temperature):
    params = [SamplingParams(max_tokens=2, temperature=temperature, seed=i, ignore_eos=True) for i in range(N)]
    outs = llm.generate([prompt] * N, params)
    return collections.Counter(tuple(o.token_ids) for o in outs)


def _chi2_pvalue(counts, probs):
    obs = np.array([counts.get((a, b), 0) for a in range(V) for b in range(V)], float)
    exp = probs.reshape(-1) * obs.sum()
    order = np.argsort(exp)  # merge the rarest cells until each expected count is >= 5
    merged_o, merged_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o += obs[i]
        acc_e += exp[i]
        if acc_e >= 5:
            merged_o.append(acc_o)
            merged_e.append(acc_e)
            acc_o = acc_e = 0.0
    merged_o[-1] += acc_o
    merged_e[-1] += acc_e
    merged_e = np.array(merged_e) * (sum(merged_o) / sum(merged_e))  # exact totals for scipy
    return stats.chisquare(merged_o, merged_e).pvalue


@pytest.mark.parametrize("spec", ["draft", "ngram", "eagle"])
def test_sampling_is_lossless(tiny, spec, tmp_path):
    t, d, hf = tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # repeats, so the n-gram proposer proposes too
    if spec == "eagle":  # 8 of the 12 tokens: q is zero on the rest, the residual must cover them
        d = make_eagle_head(t, tmp_path / "eagle", seed=6, draft_vocab=8, std=0.6)
    llm = LLM(
        t,
        speculative_model=str(d) if spec != "ngram" else "ngram",
        num_speculative_tokens=2,
        max_slots=64,
        page_size=8,
        max_model_len=32,
        num_pages=300,
        token_buckets=(64,),  # one step holds a row for each of the 64 slots
        enable_prefix_caching=False,
        speculative_disable_by_batch_size=64,
        prompt_lookup_min=1,  # a 1-token match proposes: the prompt's repeats are single tokens
        speculative_adaptive=False,  # every proposal is verified
        **COLD,
    )
    counts = _sampled_pairs(llm, prompt, 1.0)
    assert llm.spec_stats.proposed[0] > N // 2  # drafts were really proposed and judged
    assert 0 < llm.spec_stats.accepted[0] < llm.spec_stats.proposed[0]  # both outcomes of the rule occur
    pvalue = _chi2_pvalue(counts, _exact_two_token_probs(hf, prompt, 1.0))
    print(f"{spec}: chi-square p = {pvalue:.3g}")
    assert pvalue > 1e-3


def test_chi_square_rejects_a_wrong_acceptance_rule(tiny, monkeypatch):
    t, d, hf = tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    # Wrong: after a rejection, resample from p instead of normalize(max(0, p - q)).
    monkeypatch.setattr(speculative, "residual", lambda p, q, rejected: p)
    llm = LLM(
        t,
        speculative_model=str(d),
        num_speculative_tokens=2,
        max_slots=64,
        page_size=8,
        max_model_len=32,
        num_pages=300,
        token_buckets=(64,),  # one step holds a row for each of the 64 slots
        enable_prefix_caching=False,
        speculative_disable_by_batch_size=64,
        prompt_lookup_min=1,  # a 1-token match proposes: the prompt's repeats are single tokens
        **COLD,
    )
    counts = _sampled_pairs(llm, prompt, 1.0)
    pvalue = _chi2_pvalue(counts, _exact_two_token_probs(hf, prompt, 1.0))
    print(f"wrong rule: chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-3


def test_eagle_head_reads_the_targets_features(tok_model, tmp_path):
    """An "echo" head (fc passes the feature through, the layer adds nothing, the LM head is the
    target's) drafts argmax(target LM head(feature at the previous position)): the target's own
    greedy token there. So after the prompt's KV (and features) are filled, its drafts for the
    row [prompt[-1]] are all the dense target's greedy token at position L-2, and the feature
    pages hold the dense target's final-norm hidden states; a feature misplaced by a position or
    never written drafts something else."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models import eagle
    from jaxserve.models.loader import load_model
    from jaxserve.runner.step_batch import Chunk

    target, cfg = load_model(tok_model[0], dtype=jnp.float32)
    h, v, k = cfg.hidden_size, cfg.vocab_size, 3
    head = eagle.EagleHead(eagle.EagleConfig.for_target(cfg, v), rngs=nnx.Rngs(0))
    fc = np.zeros((2 * h, h), np.float32)
    fc[h:] = np.eye(h)
    head.fc.kernel[...] = jnp.asarray(fc)
    head.layer.self_attn.o_proj.kernel[...] = jnp.zeros((h, h))
    head.layer.mlp.down_proj.kernel[...] = jnp.zeros_like(head.layer.mlp.down_proj.kernel[...])
    lm = target.embed_tokens.embedding[...].T if cfg.tie_word_embeddings else target.lm_head.kernel[...]
    head.lm_head.kernel[...] = lm
    eagle.save_head(head, tmp_path / "echo")

    llm = LLM(
        tok_model[0],
        speculative_model=str(tmp_path / "echo"),
        num_speculative_tokens=k,
        num_pages=64,
        matmul_dtype="float32",
        **OPTS,
        **COLD,
    )
    r = llm.core.runner
    prompt = [int(x) for x in np.random.default_rng(4).integers(3, 500, 21)]
    n = len(prompt)
    pages = list(range(1, 1 + -(-(n + k + 1) // OPTS["page_size"])))
    r.prefill([Chunk(prompt[:-1], 0, pages)])
    logits, _, hidden = target(jnp.asarray([prompt]), jnp.arange(n)[None], return_hidden=True)
    d = r.draft
    ps = OPTS["page_size"]
    slots = [pages[p // ps] * ps + p % ps for p in range(n - 1)]
    feats = np.asarray(d.kv[1][0]).reshape(-1, h)[slots]
    np.testing.assert_allclose(feats, np.asarray(hidden[0, : n - 1]), atol=1e-4)
    row = Chunk([prompt[-1]] + [0] * k, n - 1, pages, (0.0, 0, 1.0, 0, 0), k)
    batch = r.batch([row], 1, k + 1, row_len=k + 1)
    d.kv, drafts, _ = r._propose(d.params, d.kv, batch, do_sample=False)
    want = int(np.argmax(np.asarray(logits[0, n - 2])))
    assert np.asarray(drafts)[0].tolist() == [want] * k


def test_a_stop_string_inside_a_speculative_step_ends_the_tokens_as_plain_decoding_does():
    """A speculative step can accept drafts past the token that completes a stop string; plain
    decoding stops at that token. The request's token_ids (and so its usage) end there too,
    not only its text. The stop string is picked from the engine's own steps: one that the
    first token of a multi-token step completes."""
    from conftest import TEST_MODEL

    opts = dict(max_slots=2, page_size=16, max_model_len=256, token_buckets=(16, 32, 64), enable_prefix_caching=False)
    plain = LLM(TEST_MODEL, **opts, **COLD)
    # every proposal verified: adaptive lookup decides from step times measured on this host, and
    # this test needs the multi-token steps whatever the host's timing
    spec = LLM(
        TEST_MODEL,
        speculative_model="ngram",
        num_speculative_tokens=4,
        prompt_lookup_min=1,
        speculative_adaptive=False,
        **opts,
        **COLD,
    )
    tok = plain.tokenizer
    prompt, base = "def parse(data):\n    return ", dict(max_tokens=60, temperature=0, ignore_eos=True)
    spec.add_request(prompt, SamplingParams(**base))
    steps = []
    while spec.has_unfinished():
        steps += [list(o.token_ids) for o in spec.step() if o.token_ids]
    ids = [t for s in steps for t in s]
    full = tok.decode(ids, skip_special_tokens=True)
    stop, pos = None, 0
    for s in steps:
        if len(s) >= 2:  # a step that accepted drafts: its first token completes `stop`
            head = tok.decode(ids[: pos + 1], skip_special_tokens=True)
            stop = next((head[-n:] for n in range(1, len(head) + 1) if full.find(head[-n:]) == len(head) - n), None)
            if stop and stop.strip():
                break
            stop = None
        pos += len(s)
    assert stop is not None, f"no multi-token step to test with: {steps}"
    params = SamplingParams(stop=[stop], **base)
    want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.finish_reason == want.finish_reason == "stop"
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert len(got.token_ids) == pos + 1


class FrozenCosts(StepCosts):
    """Step costs that the steps served do not move."""

    def observe(self, kind: str, size: int, seconds: float, weight: float = 0.2) -> None:
        pass


def test_adaptive_lookup_speculates_only_where_it_pays():
    """Adaptive prompt lookup (the default for "ngram"): on the shipped test model, whose greedy
    code falls into loops, requests speculate once their shadow windows show drafts being right,
    and steps where nothing pays run plain; the tokens are plain decoding's, no step compiles
    after warm-up, and the cost table it chose by was timed at warm-up."""
    opts = dict(max_slots=4, page_size=8, max_model_len=160, num_pages=120, token_buckets=(1, 8, 16, 32, 64))
    llm = LLM(TEST_MODEL, speculative_model="ngram", num_speculative_tokens=5, **opts)
    assert llm.core.policy is not None and set(llm.core.policy.costs.table["spec"]) >= {2, 6}
    # From here on the policy decides by a fixed table (a verify step of 6 tokens costs 1.4 plain
    # steps), so what it chooses depends on the drafts' acceptance only, not on this host's load.
    llm.core.policy.costs = FrozenCosts({"plain": {1: 1.0, 16: 2.0}, "spec": {2: 1.1, 16: 2.2}})
    prompts = ["def parse(data):\n    return ", "import os\n", "class Stack:\n    def push(self, x):\n", "x = 1\n"]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    before = compile_count()
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert compile_count() == before
    assert got == [o.token_ids for o in LLM(TEST_MODEL, **opts, **COLD).generate(prompts, params)]
    st = llm.stats()
    assert st["spec_target_steps"] > 0 and st["spec_plain_steps"] > 0
    assert st["spec_mean_accepted"] > 1.5  # it speculated where drafts were right
    assert not llm.core.policy.seqs  # finished requests leave nothing behind
    llm.flush_prefix_cache()
    assert llm.allocator.num_free == llm.allocator.capacity


def test_seeded_sampling_equals_plain_decoding_under_prompt_lookup():
    """Prompt lookup verifies by plain decoding's own draws (speculative.accept_exact): seeded
    sampled requests get plain decoding's tokens, token for token, with every proposal verified
    and drafts accepted and rejected (the shipped test model's code repeats itself)."""
    opts = dict(max_slots=4, page_size=8, max_model_len=160, num_pages=120, token_buckets=(16, 32, 64), **COLD)
    llm = LLM(TEST_MODEL, speculative_model="ngram", num_speculative_tokens=3, speculative_adaptive=False, **opts)
    prompts = ["def parse(data):\n    return ", "import os\n", "class Stack:\n    def push(self, x):\n", "x = 1\n"]
    params = [SamplingParams(max_tokens=50, temperature=t, top_p=0.95, seed=i, ignore_eos=True) for i, t in
              enumerate((0.3, 0.6, 1.0, 0.3))]  # fmt: skip
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [o.token_ids for o in LLM(TEST_MODEL, **opts).generate(prompts, params)]
    st = llm.stats()
    assert 1.0 < st["spec_mean_accepted"] < 4.0
