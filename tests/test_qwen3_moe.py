"""Qwen3-MoE against transformers in float32: a tiny random `Qwen3MoeConfig` (8 experts, top-2,
renormalised, layer 1 of 3 a dense MLP among the MoE layers) saved with save_pretrained (one
tensor per expert, as real checkpoints). Which layers have experts, logits within the Llama
tests' 1e-4, greedy continuations, the engine's greedy outputs over a mixed batch with
preemption and prefix-cache hits, and tensor parallelism (experts replicated) against one device."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model, run_on_devices
from test_qwen3 import assert_matches_transformers, engine_matches_transformers

from jaxserve.models import qwen3_moe
from jaxserve.models.loader import load_model
from jaxserve.models.model_config import ModelConfig


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe")
    return d, make_hf_model("qwen3_moe", d)


def test_sparse_layers_are_the_ones_transformers_builds():
    """mlp_only_layers and decoder_sparse_step pick the same layers as transformers' decoder."""
    import transformers as tf

    for only, step in (([1], 1), ([3], 2), ([], 3), ([0, 5], 1)):
        hf_cfg = tf.Qwen3MoeConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=only,
            decoder_sparse_step=step,
        )
        hf_cfg.architectures = ["Qwen3MoeForCausalLM"]
        model = tf.Qwen3MoeForCausalLM(hf_cfg)
        want = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        assert ModelConfig.from_hf(hf_cfg).sparse_layers == want, (only, step)


def test_config_and_bad_fields_are_named(moe):
    cfg = ModelConfig.from_dir(moe[0])
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm and cfg.head_dim == 32
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 48)
    assert cfg.norm_topk_prob and cfg.sparse_layers == (0, 2)
    hf_params = sum(p.numel() for p in moe[1].parameters())
    assert cfg.num_params() == hf_params
    raw = {**moe[1].config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"):
        ModelConfig.from_hf({**raw, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="moe_intermediate_size must be a positive integer"):
        ModelConfig.from_hf({**raw, "moe_intermediate_size": 0})


def test_routing_spreads_over_the_experts(moe):
    """The test model's router sends a prompt's tokens to most experts (so the grouped matmul
    runs groups of several sizes, some empty), as transformers routes them."""
    path, hf = moe
    tokens = torch.tensor(np.random.default_rng(0).integers(2, 512, (1, 40)))
    seen = []
    hook = hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[2]))
    with torch.no_grad():
        hf(tokens)
    hook.remove()
    counts = np.bincount(seen[0].numpy().ravel(), minlength=8)
    assert (counts > 0).sum() >= 6 and counts.max() < 40


def test_logits_and_greedy_continuation_match_transformers(moe):
    path, hf = moe
    model, cfg = load_model(path, dtype=jnp.float32)
    assert isinstance(model.layers[0].mlp, qwen3_moe.SparseMoe) and not isinstance(
        model.layers[1].mlp, qwen3_moe.SparseMoe
    )
    assert_matches_transformers(model, cfg, hf)


def test_engine_greedy_with_preemption_and_prefix_cache_matches_transformers(moe):
    path, hf = moe
    engine_matches_transformers(path, hf, 512)


TP_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np, jax
    from jaxserve import LLM, SamplingParams
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 50)))] for _ in range(8)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 25, 8)]
    opts = dict(max_slots=4, page_size=8, max_model_len=128, num_pages=96, token_buckets=(16, 64), warmup=False)
    out = {}
    for tp in (1, 4):
        llm = LLM(sys.argv[1], tensor_parallel_size=tp, **opts)
        out[tp] = [o.token_ids for o in llm.generate(prompts, params)]
    print("RESULT" + json.dumps(out))
""")


def test_tensor_parallel_greedy_equals_one_device(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe_tp")
    make_hf_model("qwen3_moe", d, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    res = run_on_devices(TP_SCRIPT, 4, d)
    assert res[4] == res[1]
