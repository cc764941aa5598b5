"""Qwen3 (dense) against transformers in float32: a tiny random `Qwen3Config` (head_dim 32, not
hidden / heads; per-head q/k norms made non-trivial; tied embeddings) saved with save_pretrained.
Logits within the Llama tests' 1e-4, greedy continuations token for token, the serving engine's
greedy outputs over a mixed batch with preemption and prefix-cache hits, a Qwen3 GGUF written
here with the `gguf` package's writer, and tensor parallelism on 8 CPU devices against one."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_hf_model, run_on_devices
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from test_gguf import add_hf_tensors, add_shape
from test_llama import _greedy_dense

from jaxserve import LLM, SamplingParams
from jaxserve.models import registry
from jaxserve.models.loader import load_model
from jaxserve.models.model_config import ModelConfig
from jaxserve.runner.executable_cache import compile_count

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    return d, make_hf_model("qwen3", d)


def test_config_reads_head_dim_and_qk_norm(qwen3):
    cfg = ModelConfig.from_dir(qwen3[0])
    assert cfg.architecture == "Qwen3ForCausalLM" and registry.model_class(cfg.architecture).__name__ == (
        "Qwen3ForCausalLM"
    )
    assert (cfg.head_dim, cfg.hidden_size // cfg.num_heads) == (32, 16)
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.sliding_window is None


def _last_logits_error(model, hf, vocab: int) -> float:
    rng = np.random.default_rng(1)
    lengths = [5, 17, 33]
    prompts = [rng.integers(2, vocab, n) for n in lengths]
    batch = np.zeros((len(prompts), max(lengths)), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p  # right padding: invisible to earlier positions under the causal mask
    positions = jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)
    logits, _ = model(jnp.asarray(batch), positions, logits_index=jnp.asarray([n - 1 for n in lengths]))
    err = 0.0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor(p[None])).logits[0, -1].numpy()
        err = max(err, float(np.abs(np.asarray(logits[i]) - ref).max()))
        assert ref.max() - np.sort(ref)[-2] > 1e-3  # peaked enough for argmax tests to mean something
    return err


def assert_matches_transformers(model, cfg: ModelConfig, hf) -> None:
    """Last-position logits of a right-padded batch within 1e-4 of transformers', and 32
    greedy tokens identical to its generate."""
    assert _last_logits_error(model, hf, cfg.vocab_size) < 1e-4
    prompt = [int(x) for x in np.random.default_rng(2).integers(2, cfg.vocab_size, 11)]
    assert _greedy_dense(model, prompt, 32) == hf_greedy(hf, prompt, 32)


def test_logits_and_greedy_continuation_match_transformers(qwen3):
    path, hf = qwen3
    model, cfg = load_model(path, dtype=jnp.float32)
    assert_matches_transformers(model, cfg, hf)


def mixed_shared_prefix_requests(vocab: int, seed: int, n: int = 12) -> tuple[list[list[int]], list[int]]:
    """n prompts of mixed length, half of them opening with one 24-token prefix (three whole
    8-token pages: prefix-cache hits), and mixed output lengths."""
    rng = np.random.default_rng(seed)
    shared = [int(x) for x in rng.integers(3, vocab, 24)]
    prompts = []
    for i in range(n):
        own = [int(x) for x in rng.integers(3, vocab, int(rng.integers(1, 40)))]
        prompts.append(shared + own if i % 2 else own)
    return prompts, [int(x) for x in rng.integers(1, 50, n)]


def engine_matches_transformers(path, hf, vocab: int, seed: int = 1, **options) -> None:
    """The serving engine (8 slots, a 24-page pool of 8 tokens: requests growing to ~100 tokens
    preempt; prefix caching on; LLM `options` beside) gives each request transformers' greedy
    tokens run alone, without compiling after warm-up, and every page comes back."""
    llm = LLM(path, max_slots=8, page_size=8, max_model_len=160, num_pages=24, token_buckets=(16, 32, 64), **options)
    prompts, outs = mixed_shared_prefix_requests(vocab, seed=seed)
    before = compile_count()
    results = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in outs])
    assert compile_count() == before
    assert llm.scheduler.num_preemptions > 0
    assert any(r.num_cached_prompt_tokens >= 16 for r in results)
    for p, m, r in zip(prompts, outs, results):
        assert r.token_ids == hf_greedy(hf, p, m)
    llm.flush_prefix_cache()
    assert llm.allocator.num_free == llm.allocator.capacity
    local = llm.core.kv.local  # a model with sliding layers: their pool too
    assert local is None or local.num_free == local.capacity


def test_engine_greedy_with_preemption_and_prefix_cache_matches_transformers(qwen3):
    path, hf = qwen3
    engine_matches_transformers(path, hf, 512)


def write_qwen3_gguf(path, hf, qtype: Q | None) -> None:
    """A transformers Qwen3 as llama.cpp's converter writes it (`qwen3` metadata, its tensor
    names, Q/K rows as transformers has them), the 2-D weights in `qtype` (None: float32)."""
    cfg = hf.config
    w = GGUFWriter(str(path), "qwen3")
    add_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_eos_token_id(cfg.eos_token_id)
    norms = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    add_hf_tensors(w, hf, qtype, norms, permute=False)


def test_written_gguf_loads_and_matches(qwen3, tmp_path):
    """float32: the logits transformers computes from the same weights, and its greedy tokens;
    Q8_0: the config as read from config.json and logits near float32's (transformers' own
    GGUF reader takes no `qwen3.attention.key_length`, so it cannot be this file's oracle)."""
    path, hf = qwen3
    f32 = tmp_path / "qwen3-f32.gguf"
    write_qwen3_gguf(f32, hf, None)
    model, cfg = load_model(f32, dtype=jnp.float32)
    want = ModelConfig.from_dir(path)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.head_dim, cfg.qk_norm, cfg.tie_word_embeddings, cfg.qkv_bias, cfg.rope_theta) == (
        32,
        True,
        True,
        False,
        1e6,
    )
    assert cfg.num_params() == want.num_params()
    assert _last_logits_error(model, hf, cfg.vocab_size) < 1e-4
    prompt = [int(x) for x in np.random.default_rng(5).integers(2, cfg.vocab_size, 9)]
    assert _greedy_dense(model, prompt, 16) == hf_greedy(hf, prompt, 16)
    q8 = tmp_path / "qwen3-q8_0.gguf"
    write_qwen3_gguf(q8, hf, Q.Q8_0)
    qmodel, _ = load_model(q8, dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(6).integers(2, cfg.vocab_size, (1, 16)))
    a, b = (np.asarray(m(tokens, jnp.arange(16)[None])[0]) for m in (model, qmodel))
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


TP_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np, jax
    from jaxserve import LLM, SamplingParams
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 50)))] for _ in range(8)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 25, 8)]
    opts = dict(max_slots=4, page_size=8, max_model_len=128, num_pages=96, token_buckets=(16, 64), warmup=False)
    out = {}
    for tp in (1, 2, 8):
        llm = LLM(sys.argv[1], tensor_parallel_size=tp, **opts)
        q = llm.runner.target.state["layers"][0]["self_attn"]["q_proj"]["kernel" if tp > 1 else "packed"]
        out[tp] = {"tokens": [o.token_ids for o in llm.generate(prompts, params)],
                   "q_proj": [tuple(s.data.shape) for s in q.get_value().addressable_shards][:1]}
    print("RESULT" + json.dumps(out))
""")


def test_tensor_parallel_greedy_equals_one_device(tmp_path_factory):
    """8 query heads of 32 (hidden 64), 4 KV heads: tp=2 splits KV heads, tp=8 replicates them."""
    d = tmp_path_factory.mktemp("qwen3_tp")
    make_hf_model("qwen3", d, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    res = run_on_devices(TP_SCRIPT, 8, d)
    for tp in (2, 8):
        assert res[tp]["tokens"] == res[1]["tokens"], tp
        assert res[tp]["q_proj"] == [[64, 8 * 32 // tp]]  # whole heads per chip
