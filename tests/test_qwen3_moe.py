"""Qwen3-MoE against transformers in float32: a tiny random `Qwen3MoeConfig` (8 experts, top-2,
renormalised, layer 1 of 3 a dense MLP among the MoE layers) saved with save_pretrained (one
tensor per expert, as real checkpoints). Which layers have experts, logits within the Llama
tests' 1e-4, greedy continuations, the engine's greedy outputs over a mixed batch with
preemption and prefix-cache hits, and tensor parallelism (experts replicated) against one device."""

from __future__ import annotations

import textwrap

import jax
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


@pytest.mark.parametrize("rows", [24, 600])  # tiles of 8 rows, and of 32
def test_grouped_swiglu_is_each_experts_swiglu_on_its_rows(rows):
    """Rows sorted by expert, groups uneven and some empty, the last rows past every group: each
    group's rows get their expert's SwiGLU (NumPy, float64), the rows past the groups zeros."""
    rng = np.random.default_rng(rows)
    e, h, f = 6, 16, 12
    sizes = np.array([0, 3, 1, 0, 9, 2]) * (rows // 24)
    x = rng.standard_normal((rows, h))
    gate, up, down = rng.standard_normal((e, h, f)), rng.standard_normal((e, h, f)), rng.standard_normal((e, f, h))
    got = np.asarray(
        qwen3_moe.grouped_swiglu(*(jnp.asarray(a, jnp.float32) for a in (x, gate, up, down)), jnp.asarray(sizes))
    )
    want, start = np.zeros((rows, h)), 0
    for g, n in enumerate(sizes):
        a, u = x[start : start + n] @ gate[g], x[start : start + n] @ up[g]
        want[start : start + n] = (a / (1 + np.exp(-a)) * u) @ down[g]
        start += n
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not got[start:].any()


def _np_swiglu(x, gate, up, down, sizes, round_act=lambda a: a):
    """Each group's rows through its expert's SwiGLU in float64 (the activation rounded by
    `round_act` before down); zeros past the groups."""
    want, start = np.zeros((x.shape[0], down.shape[-1])), 0
    for g, n in enumerate(sizes):
        a, u = x[start : start + n] @ gate[g], x[start : start + n] @ up[g]
        want[start : start + n] = round_act(a / (1 + np.exp(-a)) * u) @ down[g]
        start += n
    return want, start


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
def test_packed_experts_are_each_experts_swiglu_on_its_rows(storage):
    """The experts packed for the native grouped matmul (Experts.pack_native; on the CPU the
    runner does this) against NumPy in float64 on the weights the kernel holds (the int8 ones
    dequantized; bfloat16 ones and the rows x, act it multiplies rounded to bfloat16): empty
    experts, one row, every row to one expert, more rows than a work item, rows past the groups."""
    from types import SimpleNamespace

    from flax import nnx

    from pallas_kernels import native_matmul

    if storage == "bfloat16" and not native_matmul.bf16_available():
        pytest.skip(native_matmul.bf16_unavailable_reason())
    cfg = SimpleNamespace(num_experts=6, hidden_size=40, moe_intermediate_size=72)
    for sizes in ([0, 3, 1, 0, 9, 2], [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 30], [70, 0, 5, 0, 0, 1]):
        experts = qwen3_moe.Experts(cfg, jnp.float32, nnx.Rngs(sum(sizes)), 0.3)
        if storage == "int8":
            experts.quantize_stacks()
        gate, up, down = (np.asarray(w, np.float64) for w in experts.weights(jnp.float32))
        assert experts.pack_native(storage if storage == "bfloat16" else "float32") and experts.packed_native
        x = np.random.default_rng(len(sizes)).standard_normal((sum(sizes) + 2, 40)).astype(np.float32)
        got = np.asarray(jax.jit(experts.native_swiglu)(x, jnp.asarray(sizes, jnp.int32)))
        if storage == "bfloat16":  # the kernel rounds x, the weights and the activation to bfloat16
            want, start = _np_swiglu(_bf16(x), _bf16(gate), _bf16(up), _bf16(down), sizes, round_act=_bf16)
            tol = 1e-2
        else:
            want, start = _np_swiglu(x.astype(np.float64), gate, up, down, sizes)
            tol = 1e-4
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=str(sizes))
        assert not got[start:].any()


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


PARALLEL_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np, jax
    from flax import nnx
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.executable_cache import compile_count
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 50)))] for _ in range(8)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 25, 8)]
    opts = dict(max_slots=4, page_size=8, max_model_len=128, num_pages=96, token_buckets=(16, 64))
    out = {}
    # (tp, ep): one device, tensor parallel alone (experts replicated), experts split 8 ways,
    # and 4 x 2 (experts over 4, attention over 2). Only the split runs warm up: they count compiles.
    for tp, ep in ((1, 1), (4, 1), (1, 8), (2, 4)):
        llm = LLM(sys.argv[1], tensor_parallel_size=tp, expert_parallel_size=ep, warmup=ep > 1, **opts)
        before = compile_count()
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        state = llm.runner.target.state["layers"][0]["mlp"]
        experts = state["experts"]  # one device: packed for the native grouped matmul (gate_up)
        gate = (experts["gate_proj"] if "gate_proj" in experts else experts["gate_up"]).get_value()
        layer0 = nnx.merge(llm.runner.target.graphdef, llm.runner.target.state).layers[0].mlp
        out[f"{tp}x{ep}"] = {
            "tokens": tokens,
            "compiles": compile_count() - before,
            "expert_shards": sorted({tuple(sh.data.shape) for sh in gate.addressable_shards}),
            "expert_devices": len(gate.sharding.device_set),
            "mesh": None if layer0.mesh is None else dict(layer0.mesh.shape),  # the layer's own shard_map
            "router_shards": sorted({tuple(sh.data.shape) for sh in state["gate"]["weight"].get_value().addressable_shards}),
        }
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe_parallel")
    make_hf_model("qwen3_moe", d, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    return run_on_devices(PARALLEL_SCRIPT, 8, d)


@pytest.mark.parametrize("run", ["4x1", "1x8", "2x4"])
def test_tensor_and_expert_parallel_greedy_equals_one_device(parallel, run):
    """tensor_parallel_size x expert_parallel_size on 8 CPU devices: the greedy tokens of one
    device, and (after warm-up) no compile while serving."""
    assert parallel[run]["tokens"] == parallel["1x1"]["tokens"]
    if run != "4x1":  # warmed up (tensor parallelism's no-recompile check is test_sharding's)
        assert parallel[run]["compiles"] == 0


@pytest.mark.parametrize("run, ep, devices", [("1x8", 8, 8), ("2x4", 4, 8)])
def test_each_device_holds_its_share_of_the_experts(parallel, run, ep, devices):
    """The stacked experts [8, 64, 48] split by their leading axis: 8 / ep experts a device; the
    router stays whole on every device."""
    res = parallel[run]
    assert res["expert_shards"] == [[8 // ep, 64, 48]]
    assert res["expert_devices"] == devices
    assert res["router_shards"] == [[8, 64]]
    assert res["mesh"] == {"expert": ep, "tp": devices // ep}  # dispatched in the layer's shard_map
    assert parallel["4x1"]["mesh"] is None  # no expert axis: XLA places the replicated experts
    assert parallel["4x1"]["expert_shards"] == [[8, 64, 48]]  # tensor parallelism alone: replicated


def test_expert_parallel_bad_sizes_are_named(moe, hf_models):
    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.parallel.sharding import check_expert_parallel, make_mesh

    with pytest.raises(ValueError, match="expert_parallel_size must be >= 1"):
        EngineConfig(expert_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 must divide the model's num_experts \(8\)"):
        check_expert_parallel(ModelConfig.from_dir(moe[0]), 3)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts model"):
        check_expert_parallel(ModelConfig.from_dir(hf_models["llama"][0]), 2)
    with pytest.raises(ValueError, match=r"expert_parallel_size must divide the device count \(1\)"):
        make_mesh(1, ep=2)  # this process has one device
