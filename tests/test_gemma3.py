"""Gemma 3 (text) against transformers in float32: a tiny random `Gemma3TextConfig` saved with
save_pretrained, 6 layers in the 5 local : 1 global pattern, a sliding window of 8 tokens (the
prompts and continuations run several windows long), head_dim 32 (not hidden / heads),
query_pre_attn_scalar 24 (not head_dim), RoPE bases 10k local / 1M global with linear scaling on
the global layers, every norm weight drawn around 0 (the norms scale by 1 + w), tied embeddings.

Logits within the Llama/Qwen3 tests' 1e-4 and greedy continuations token for token in the plain
forward pass; the same model without its window is far off (so the window is what matches);
the serving engine's greedy tokens over a mixed batch with preemption and prefix-cache hits,
through the native CPU attention (the default) and the XLA loop. And Mistral's window, masked now
rather than capping the context, against transformers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_hf_model, run_on_devices
from test_qwen3 import (
    GREEDY,
    TP_SCRIPT,
    _last_logits_error,
    assert_matches_transformers,
    mixed_shared_prefix_requests,
)

from jaxserve import LLM, SamplingParams
from jaxserve.models import gemma3, registry
from jaxserve.models.loader import load_model
from jaxserve.models.model_config import ModelConfig
from jaxserve.runner.executable_cache import compile_count

WINDOW = 8


def make_gemma3(path, seed: int = 0, **overrides):
    """A tiny random Gemma3ForCausalLM with peaked outputs, saved to `path`."""
    import transformers as tf

    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    base.update(overrides)
    cfg = tf.Gemma3TextConfig(**base)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # the norms start at 0 (a scale of 1 + 0); make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    return d, make_gemma3(d)


def test_config_maps_layer_kinds_rope_and_scale(gemma):
    cfg = ModelConfig.from_dir(gemma[0])
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert registry.model_class(cfg.architecture) is gemma3.Gemma3ForCausalLM
    assert [cfg.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert (cfg.rope_theta, cfg.rope_local_theta, dict(cfg.rope_scaling)) == (
        1e6,
        1e4,
        {"rope_type": "linear", "factor": 2.0},
    )
    assert cfg.attn_scale == 24**-0.5 and cfg.head_dim == 32 and cfg.tie_word_embeddings
    assert cfg.max_context == 512  # the window is masked, so it does not cap the context
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "key,value",
    [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0), ("hidden_activation", "gelu")],
)
def test_config_refuses_what_is_not_computed(key, value):
    import transformers as tf

    hf = tf.Gemma3TextConfig(num_hidden_layers=2, **{key: value})
    hf.architectures = ["Gemma3ForCausalLM"]
    with pytest.raises(ValueError, match=key if "softcapping" in key else "hidden_activation"):
        ModelConfig.from_hf(hf)


def test_logits_and_greedy_continuation_match_transformers(gemma):
    path, hf = gemma
    model, cfg = load_model(path, dtype=jnp.float32)
    assert_matches_transformers(model, cfg, hf)


def test_the_window_is_what_matches(gemma):
    """The same weights with every layer global miss transformers' logits by far more than the
    tolerance: prompts of 17 and 33 tokens span several windows of 8."""
    path, hf = gemma
    full, cfg = load_model(path, dtype=jnp.float32)
    for layer in full.layers:
        layer.self_attn.window = None
    assert _last_logits_error(full, hf, cfg.vocab_size) > 1e-2


def engine_greedy(path, hf, **options) -> None:
    """8 slots over a 24-page pool of 8 tokens (requests grow to ~110 tokens: preemption),
    prefix caching on: each request gets transformers' greedy tokens run alone, with no compile
    after warm-up."""
    llm = LLM(path, max_slots=8, page_size=8, max_model_len=160, num_pages=24, token_buckets=(16, 32, 64), **options)
    prompts, outs = mixed_shared_prefix_requests(512, seed=3)
    before = compile_count()
    results = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in outs])
    assert compile_count() == before
    assert llm.scheduler.num_preemptions > 0
    assert any(r.num_cached_prompt_tokens >= 16 for r in results)
    for p, m, r in zip(prompts, outs, results):
        assert r.token_ids == hf_greedy(hf, p, m)


@pytest.mark.parametrize("attention_impl", ["native", "xla"])
def test_engine_greedy_matches_transformers(gemma, attention_impl):
    path, hf = gemma
    engine_greedy(path, hf, attention_impl=attention_impl)


def test_sliding_window_from_rope_fields_of_an_older_config():
    """A config.json of transformers 4 (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) maps to the same fields."""
    get = {
        "num_hidden_layers": 12,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256,
    }.get
    fields = gemma3.config(get)
    assert fields["layer_types"] == ((gemma3.SLIDING,) * 5 + (gemma3.FULL,)) * 2
    assert (fields["rope_theta"], fields["rope_local_theta"], fields["sliding_window"]) == (1e6, 1e4, 512)
    assert dict(fields["rope_scaling"]) == {"rope_type": "linear", "factor": 8.0}
    assert np.isclose(fields["query_pre_attn_scalar"], 256)


def test_mistral_window_is_masked_not_capped(tmp_path):
    """Mistral's sliding window (every layer, no `layer_types`), now masked instead of capping
    the context at its length: a window of 8 over prompts of up to 33 tokens and 32 greedy
    tokens matches transformers."""
    hf = make_hf_model("mistral", tmp_path, sliding_window=WINDOW)
    model, cfg = load_model(tmp_path, dtype=jnp.float32)
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [WINDOW] * cfg.num_layers
    assert cfg.max_context == cfg.max_position_embeddings
    assert_matches_transformers(model, cfg, hf)


def test_tensor_parallel_greedy_equals_one_device_and_transformers(tmp_path_factory):
    """8 query heads of 32, 4 KV heads on 8 CPU devices: tp=2 splits the KV heads, tp=8
    replicates them; each layer's window goes through the per-chip attention (shard_attention).
    Every tp gives transformers' greedy tokens."""
    d = tmp_path_factory.mktemp("gemma3_tp")
    hf = make_gemma3(d, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    res = run_on_devices(TP_SCRIPT, 8, d)
    rng = np.random.default_rng(0)  # the script's prompts and lengths
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 50)))] for _ in range(8)]
    lengths = [int(m) for m in rng.integers(3, 25, 8)]
    assert res[1]["tokens"] == [hf_greedy(hf, p, m) for p, m in zip(prompts, lengths)]
    for tp in (2, 8):
        assert res[tp]["tokens"] == res[1]["tokens"], tp
        assert res[tp]["q_proj"] == [[64, 8 * 32 // tp]]  # whole heads per chip
