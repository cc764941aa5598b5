"""Tests for jaxserve.kv_math, checked against figures worked out by hand in each test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from jaxserve import kv_math as km
from jaxserve.kv_math import (
    ACCELERATORS,
    PRESETS,
    Accelerator,
    ModelShape,
    kv_bytes_per_token,
    max_concurrent_requests,
    plan,
)
from jaxserve.tools import kv_math_cli

pytestmark = pytest.mark.fast

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mixed-64.json"
H100_USABLE = 72_000_000_000  # 0.9 x 80e9
H100_RESERVE = 4_000_000_000  # default 5% of 80e9


# ------------------------------------------------------------------ KV and parameter counts
@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama-2-7b", 2 * 32 * 32 * 128 * 2),  # 524,288
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072
        ("llama-3-70b", 2 * 80 * 8 * 128 * 2),  # 327,680
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # 57,344
    ],
)
def test_kv_bytes_per_token_bf16(name: str, expected: int) -> None:
    assert kv_bytes_per_token(PRESETS[name]) == expected
    assert expected in (524_288, 131_072, 327_680, 57_344)


def test_kv_bytes_per_token_dtypes() -> None:
    m = PRESETS["llama-3-8b"]
    assert kv_bytes_per_token(m, "fp8") == 2 * 32 * 8 * (128 + 2)  # 66,560: a bfloat16 scale per token-head
    assert kv_bytes_per_token(m, "int8") == 66_560
    assert kv_bytes_per_token(m, "fp32") == 262_144


def test_num_params_match_published_counts() -> None:
    # Llama-2-7B: 2*32000*4096 + 32*(4*4096^2 + 3*4096*11008 + 2*4096) + 4096 = 6,738,415,616
    assert PRESETS["llama-2-7b"].num_params == 6_738_415_616
    # Llama-3-8B: 2*128256*4096 + 32*(4096*128*(64+16) + 3*4096*14336 + 8192) + 4096
    assert PRESETS["llama-3-8b"].num_params == 8_030_261_248
    assert PRESETS["llama-3-70b"].num_params == 70_553_706_496
    # Streamed = all but the untied input embedding (a gather, not a read of the whole table)
    assert PRESETS["llama-3-8b"].streamed_params == 8_030_261_248 - 128256 * 4096


def test_presets_architecture() -> None:
    q = PRESETS["qwen2.5-7b"]
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.intermediate_size, q.vocab_size) == (
        28,
        3584,
        28,
        4,
        18944,
        152064,
    )
    assert q.head_dim == 128 and not q.tie_word_embeddings
    mis = PRESETS["mistral-7b"]
    assert (mis.num_kv_heads, mis.intermediate_size, mis.vocab_size) == (8, 14336, 32768)
    assert PRESETS["llama-3.1-70b"].max_position_embeddings == 131072
    assert set(PRESETS) == {
        "llama-2-7b",
        "llama-3-8b",
        "llama-3.1-8b",
        "llama-3-70b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "mistral-7b",
        "qwen3-30b-a3b",
    }
    assert set(ACCELERATORS) == {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "a100-80gb", "h100", "h200", "l4"}
    assert all(a.source for a in ACCELERATORS.values())
    assert ACCELERATORS["tpu-v5e"].pads_head_dim_to == 128 and ACCELERATORS["h100"].pads_head_dim_to is None


# ------------------------------------------------------------------ capacity
def test_llama3_70b_on_one_h100_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan("llama-3-70b", "h100")
    assert not p.fits and p.max_concurrent_requests == 0
    assert "weights do not fit" in p.reason
    assert p.weight_bytes_per_chip == 2 * 70_553_706_496 > H100_USABLE
    assert max_concurrent_requests("llama-3-70b", 8192, accelerator="h100") == 0
    assert kv_math_cli.main(["--model", "llama-3-70b", "--accelerator", "h100"]) == 1
    assert "weights do not fit" in capsys.readouterr().err


def test_llama3_70b_on_eight_h100() -> None:
    p = plan("llama-3-70b", "h100", num_chips=8, context_len=8192)
    weights_per_chip = math.ceil(2 * 70_553_706_496 / 8)  # 17,638,426,624
    free = H100_USABLE - H100_RESERVE - weights_per_chip  # 50,361,573,376
    kv_per_token_per_chip = 2 * 80 * 1 * 128 * 2  # 8 kv heads / 8 chips = 1 -> 40,960
    per_request = 8192 * kv_per_token_per_chip  # 512 whole pages of 16 -> 335,544,320
    expected = free // per_request  # 150.09 -> 150
    assert (weights_per_chip, free, expected) == (17_638_426_624, 50_361_573_376, 150)
    assert p.fits and p.max_concurrent_requests == expected
    assert p.kv_free_bytes_per_chip == free and p.kv_bytes_max_request_per_chip == per_request
    assert max_concurrent_requests("llama-3-70b", 8192, accelerator="h100", num_chips=8) == expected


def test_llama31_8b_on_h100_step_time_and_cost() -> None:
    p = plan("llama-3.1-8b", "h100", context_len=8192)
    free = H100_USABLE - H100_RESERVE - 2 * 8_030_261_248  # 51,939,477,504
    per_request = 8192 * 131_072  # 1,073,741,824
    assert p.max_concurrent_requests == free // per_request == 48
    streamed = 2 * (8_030_261_248 - 128256 * 4096)  # 15,009,849,344 bytes
    assert p.step_time_batch1_s == pytest.approx((streamed + per_request) / 3.35e12)  # ~4.80 ms
    step48 = (streamed + 48 * per_request) / 3.35e12  # ~19.87 ms
    assert p.step_time_s == pytest.approx(step48)
    assert p.step_compute_bound_s == pytest.approx(2 * (8_030_261_248 - 128256 * 4096) * 48 / 989e12)
    assert p.tokens_per_s == pytest.approx(48 / step48)
    assert p.cost_per_million_output_tokens == pytest.approx(4.00 / (48 / step48 * 3600) * 1e6)
    assert p.compute_bound_from_batch is None  # 1 GB of KV per request outweighs its FLOPs at 8K


def test_compute_bound_crossover_at_short_context() -> None:
    p = plan("llama-3.1-8b", "h100", context_len=16)
    b = p.compute_bound_from_batch
    assert b is not None and b > 1
    mem, comp = p.bounds(1)
    w = p.streamed_weight_bytes_per_chip
    k = 16 * 131_072
    assert b == pytest.approx(w / (2 * p.flop_params * 3.35e12 / 989e12 - k))
    mem_b = (w + b * k) / 3.35e12
    comp_b = 2 * p.flop_params * b / 989e12
    assert mem_b == pytest.approx(comp_b)
    assert mem > comp


def test_page_rounding() -> None:
    m = PRESETS["llama-3-8b"]
    weights = km.weight_bytes(m)
    free = 1000 * 131_072 * 100  # room for exactly 100 unpaged 1000-token requests
    acc = Accelerator("test", weights + free, 1e12, 1e14, None, "test")
    kw = dict(accelerator=acc, memory_fraction=1.0, activation_reserve_bytes=0)
    assert max_concurrent_requests(m, 1000, page_size=None, **kw) == 100
    # 1000 tokens round up to 63 pages of 16 = 1008 tokens: 13,107,200,000 // (1008 * 131,072) = 99
    assert max_concurrent_requests(m, 1000, page_size=16, **kw) == 99
    p = plan(m, acc, context_len=1000, memory_fraction=1.0, activation_reserve_bytes=0, page_size=16)
    assert p.pages_per_request == 63
    assert p.kv_bytes_max_request_per_chip == 1008 * 131_072
    assert p.pages_per_chip == free // (16 * 131_072)


def test_tensor_parallel_replicates_kv_heads() -> None:
    m = PRESETS["llama-3-8b"]  # 8 kv heads
    assert km.kv_heads_per_chip(m, 4) == 2 and km.kv_heads_per_chip(m, 8) == 1
    assert km.kv_heads_per_chip(m, 16) == 1  # ceil(8/16): each chip still holds a whole head
    assert km.kv_bytes_per_token_per_chip(m, 4) == 2 * 32 * 2 * 128 * 2  # 32,768
    assert km.kv_bytes_per_token_per_chip(m, 16) == 2 * 32 * 1 * 128 * 2  # 16,384, same as on 8 chips
    # Across the 16 chips the cache holds every head twice: 16 x 16,384 = 2 x 131,072
    assert 16 * km.kv_bytes_per_token_per_chip(m, 16) == 2 * kv_bytes_per_token(m)
    p = plan(m, "h100", num_chips=16)
    assert p.kv_heads_per_chip == 1 and p.kv_bytes_per_token_per_chip == 16_384


def test_tpu_pads_head_dim_to_128() -> None:
    m = ModelShape(8, 512, 8, 4, 64, 1408, 32000, name="small")
    assert kv_bytes_per_token(m) == 2 * 8 * 4 * 64 * 2  # 8,192
    assert kv_bytes_per_token(m, pad_head_dim_to=128) == 2 * kv_bytes_per_token(m)
    assert kv_bytes_per_token(PRESETS["llama-3-8b"], pad_head_dim_to=128) == 131_072  # already 128
    tpu, gpu = plan(m, "tpu-v5e", context_len=1024), plan(m, "h100", context_len=1024)
    assert tpu.head_dim_stored == 128 and gpu.head_dim_stored == 64
    assert tpu.kv_bytes_per_token_per_chip == 2 * gpu.kv_bytes_per_token_per_chip


def test_traffic_pattern_means() -> None:
    p = plan("llama-3.1-8b", "h100", mean_prompt=1000, mean_output=500)
    t = p.traffic
    assert t is not None and t["mean_kv_tokens"] == 1250  # prompt + half the output
    per_request = math.ceil(1250 / 16) * 16 * 131_072  # 79 pages = 1264 tokens
    assert t["concurrent_requests"] == p.kv_free_bytes_per_chip // per_request
    step = (p.streamed_weight_bytes_per_chip + t["concurrent_requests"] * 1250 * 131_072) / 3.35e12
    assert t["step_time_s"] == pytest.approx(step)
    assert t["cost_per_million_output_tokens"] == pytest.approx(4.0 / (t["tokens_per_s"] * 3600) * 1e6)


def test_context_beyond_model_limit_is_noted() -> None:
    assert any("max_position_embeddings" in n for n in plan("llama-2-7b", "h100", context_len=8192).notes)


def test_predict_decode_step() -> None:
    m = ModelShape(8, 512, 8, 4, 64, 1408, 32000, name="small")
    streamed = m.streamed_params * 4
    kv = 8 * 512 * (2 * 8 * 4 * 64 * 4)
    assert km.predict_decode_step(m, 8, 512, 50e9, 200e9) == pytest.approx(
        max((streamed + kv) / 50e9, 2 * m.streamed_params * 8 / 200e9)
    )


def test_predict_decode_step_by_phases() -> None:
    """The projections at their own roofline plus the KV read: the max roofline while the
    weights' bytes dominate their FLOPs (batch 1), their FLOP time plus the KV time once the
    FLOPs do (a slow compute peak), never below the max roofline."""
    m = ModelShape(8, 512, 8, 4, 64, 1408, 32000, name="small")
    weights = m.streamed_params * 4
    kv = lambda b: b * 512 * (2 * 8 * 4 * 64 * 4)  # noqa: E731
    flops = lambda b: 2 * m.streamed_params * b  # noqa: E731
    assert km.predict_decode_step(m, 1, 512, 50e9, 200e9, phases=True) == pytest.approx((weights + kv(1)) / 50e9)
    assert km.predict_decode_step(m, 32, 512, 50e9, 20e9, phases=True) == pytest.approx(
        flops(32) / 20e9 + kv(32) / 50e9
    )
    for b in (1, 8, 32, 256):
        for peak in (20e9, 200e9, 2e12):
            assert km.predict_decode_step(m, b, 512, 50e9, peak, phases=True) >= km.predict_decode_step(
                m, b, 512, 50e9, peak
            )


# ------------------------------------------------------------------ configs
def test_from_hf_config_object_and_dict(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    m = ModelShape.from_hf_config(cfg)
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (4, 512, 8, 2, 64)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings) == (1024, 1000, 2048)
    d = {
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "head_dim": None,
    }
    q = ModelShape.from_hf_config(d, name="qwen")
    assert q.head_dim == 128 and kv_bytes_per_token(q) == 57_344
    assert ModelShape.from_hf_config({**d, "head_dim": 256}).head_dim == 256
    mha = {k: v for k, v in d.items() if k != "num_key_value_heads"}
    assert ModelShape.from_hf_config(mha).num_kv_heads == 28
    # a checkpoint directory and its config.json both resolve
    ckpt = tmp_path / "my-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(d))
    assert km.resolve_model(str(ckpt)).name == "my-ckpt"
    assert km.resolve_model(str(ckpt / "config.json")) == ModelShape.from_path(ckpt)


@pytest.mark.skipif(not WORKLOAD.exists(), reason=f"{WORKLOAD} not present")
def test_workload_file() -> None:
    data = json.loads(WORKLOAD.read_text())
    m = ModelShape.from_hf_config(data["model"])
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (8, 512, 8, 4, 64)
    assert kv_bytes_per_token(m) == 2 * 8 * 4 * 64 * 2
    # the design notes: 56.4M parameters, 23.6M outside the two 32000 x 512 embedding tables
    assert abs(m.num_params - 56.4e6) < 0.1e6
    assert abs(m.num_params - 2 * 32000 * 512 - 23.6e6) < 0.1e6
    assert m.streamed_params == m.num_params - 32000 * 512  # the LM head is read every step, the input table is not
    assert km.resolve_model(str(WORKLOAD)) == ModelShape.from_hf_config(data["model"], name="mixed-64")
    mean_p, mean_o, n = km.load_workload(WORKLOAD)
    assert (mean_p, mean_o, n) == (17210 / 64, 8885 / 64, 64)
    p = plan("llama-3.1-8b", "h100", workload=WORKLOAD)
    assert p.traffic["mean_kv_tokens"] == pytest.approx(17210 / 64 + 8885 / 128)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(memory_fraction=0), "memory_fraction"),
        (dict(memory_fraction=1.5), "memory_fraction"),
        (dict(context_len=0), "context_len"),
        (dict(num_chips=-1), "num_chips"),
        (dict(page_size=0), "page_size"),
        (dict(accelerator="tpu-v9"), "accelerator"),
        (dict(model="gpt-17"), "model"),
        (dict(kv_dtype="int4"), "kv_dtype"),
        (dict(weight_dtype="fp6"), "weight_dtype"),
        (dict(price_per_chip_hour=-1.0), "price_per_chip_hour"),
        (dict(mean_prompt=100), "mean_output"),
        (dict(mean_prompt=0, mean_output=10), "mean_prompt"),
        (dict(activation_reserve_bytes=-5), "activation_reserve_bytes"),
    ],
)
def test_bad_input_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plan(**kwargs)


def test_bad_model_shape_and_preset_list() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape(0, 512, 8, 4, 64, 1408, 32000)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="llama-3.1-8b"):  # lists the presets
        km.resolve_model("nope")


# ------------------------------------------------------------------ CLI
def test_cli_unknown_preset_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_math_cli.main(["--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err
    assert kv_math_cli.main(["--memory-fraction", "0"]) == 2
    assert "memory_fraction" in capsys.readouterr().err
    assert kv_math_cli.main(["--chips", "two"]) == 2


def test_cli_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        kv_math_cli.main(
            ["--model", "llama-3-70b", "--chips", "8", "--json", "--mean-prompt", "500", "--mean-output", "200"]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["max_concurrent_requests"] == 150 and d["fits"] is True and d["traffic"]["mean_kv_tokens"] == 600
    assert kv_math_cli.main([]) == 0
    out = capsys.readouterr().out
    assert "max concurrent requests" in out and "48" in out


def test_cli_plot_writes_png(tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    assert kv_math_cli.main(["--model", "llama-3.1-8b", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_host_small() -> None:
    host = kv_math_cli.measure_host(size_bytes=8 * 1024 * 1024, repeats=1)
    assert host["memory_bandwidth"] > 0 and host["matmul_flops_fp32"] > 0
    assert host["matmul_flops"] == host["matmul_flops_fp32"]


def test_measure_host_bf16_rate_is_the_compute_bound() -> None:
    """With bfloat16 weights the compute bound is the native bfloat16 matmul's rate (where it
    runs; the float32 rate where it does not, as the suite's default ISA has it)."""
    from conftest import bf16_isas, cpu_isa

    from pallas_kernels import native_matmul

    for isa in ("avx512", *bf16_isas()):
        with cpu_isa(isa):
            host = kv_math_cli.measure_host(size_bytes=8 * 1024 * 1024, repeats=1, matmul_dtype="bfloat16")
            if native_matmul.bf16_available():
                assert host["matmul_flops"] == host["matmul_flops_bf16"] > 0
            else:
                assert "matmul_flops_bf16" not in host and host["matmul_flops"] == host["matmul_flops_fp32"]


def test_bandwidth_probe_reads_its_array_each_call() -> None:
    """Two reads from one probe, each in a plausible range for any machine that runs the suite
    (0.1-10,000 GB/s)."""
    rate = kv_math_cli.bandwidth_probe(size_bytes=32 * 1024 * 1024, repeats=2)
    reads = [rate(), rate()]
    assert all(1e8 < r < 1e13 for r in reads)


TINY = km.ModelShape(
    name="tiny",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    tie_word_embeddings=False,
    max_position_embeddings=128,
)


def test_overlapped_steps_feed_each_row_the_token_it_sampled():
    """The overlapped timing runs the engine's async path: each step's input is the previous
    step's token for the same row, read on the device. Oracle: the same steps run one at a time,
    each fed its row's token by the host."""
    import dataclasses

    runner, rows = kv_math_cli.decode_step_runner(TINY, 3, 40)
    rows = [dataclasses.replace(r, tokens=[7 + 5 * i]) for i, r in enumerate(rows)]
    secs = kv_math_cli.time_overlapped_steps(runner, rows, repeats=2)  # 4 steps: one plain, 3 fed
    assert 0 < secs < 5

    ref, _ = kv_math_cli.decode_step_runner(TINY, 3, 40)  # same weights, same pages: `rows` fit it
    step_rows = rows
    for _ in range(4):
        toks = ref.decode(step_rows, 0).tokens
        step_rows = [dataclasses.replace(r, tokens=[int(t)]) for r, t in zip(rows, toks)]
    fifth = runner.step_async(rows, False, [0, 1, 2]).result().tokens
    assert np.array_equal(fifth, ref.decode(step_rows, 0).tokens)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_measure_engine_step_runs_the_real_decode_step(quantization):
    secs = kv_math_cli.measure_engine_step(TINY, batch=2, context_len=40, repeats=3, quantization=quantization)
    assert 0 < secs < 5


# ------------------------------------------------------------------ mixture of experts
TINY_MOE = dict(
    vocab_size=128,
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    tie_word_embeddings=False,
)


def test_moe_total_and_active_params_by_hand_and_against_transformers() -> None:
    import transformers as tf

    hf_cfg = tf.Qwen3MoeConfig(**TINY_MOE)
    m = ModelShape.from_hf_config(hf_cfg)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.num_moe_layers) == (4, 2, 8, 2)
    # per layer: attention 16*8*(2*2 + 2*1) = 768, norms 2*16 + q/k norms 2*8 = 48; layer 1 a dense
    # MLP 3*16*32 = 1536; layers 0 and 2 a router 4*16 = 64 and 4 experts of 3*16*8 = 384;
    # embeddings and LM head 2*128*16 = 4096; final norm 16
    assert m.expert_params == 384
    assert m.num_params == 4096 + 3 * (768 + 48) + 1536 + 2 * (64 + 4 * 384) + 16 == 11_296
    assert m.num_params == sum(p.numel() for p in tf.Qwen3MoeForCausalLM(hf_cfg).parameters())
    assert m.active_params == 11_296 - 2 * (4 - 2) * 384 == 9_760  # 2 of 4 experts idle in 2 layers
    assert m.streamed_params == 11_296 - 2048 and m.active_streamed_params == 9_248 - 1536 == 7_712
    # a step reads E(1-(1-k/E)^b) experts a layer: 2 at b=1, 3 at b=2, 3.5 at b=3, -> 4
    assert km.experts_touched(4, 2, 1) == 2 and km.experts_touched(4, 2, 2) == 3
    assert m.streamed_params_at(1) == 7_712
    assert m.streamed_params_at(2) == 9_248 - 2 * (4 - 3) * 384 == 8_480
    assert m.streamed_params_at(3) == pytest.approx(9_248 - 2 * 0.5 * 384)
    assert m.streamed_params_at(10_000) == pytest.approx(9_248)
    dense = ModelShape.from_hf_config({**TINY_MOE, "num_experts": 0, "model_type": "qwen3"})
    assert dense.active_params == dense.num_params and dense.streamed_params_at(8) == dense.streamed_params


def test_qwen3_30b_a3b_preset_on_h100() -> None:
    m = PRESETS["qwen3-30b-a3b"]
    # 48 layers x (attention 2048*128*(64+8) + norms 2*2048 + 2*128 + router 128*2048 + 128 experts
    # of 3*2048*768) + embeddings and head 2*151936*2048 + 2048: 30.5B total, 3.35B active
    assert m.num_params == 48 * (18_874_368 + 4096 + 256 + 262_144 + 128 * 4_718_592) + 622_329_856 + 2048
    assert m.num_params == 30_532_122_624
    assert m.active_params == 30_532_122_624 - 48 * 120 * 4_718_592 == 3_353_032_704
    p = plan("qwen3-30b-a3b", "h100", context_len=8192)
    kv_req = 8192 * 2 * 48 * 4 * 128 * 2  # 805,306,368 B
    assert p.max_concurrent_requests == (H100_USABLE - H100_RESERVE - 2 * 30_532_122_624) // kv_req == 8
    # batch 1 reads the shared weights and 8 experts a layer: the active streamed parameters
    read1 = 2 * (3_353_032_704 - 151936 * 2048)
    assert p.weight_bytes_read_per_chip(1) == pytest.approx(read1)
    assert p.step_time_batch1_s == pytest.approx((read1 + kv_req) / 3.35e12)
    # batch 8: 128 * (1 - (120/128)^8) = 51.6 experts a layer
    touched = 128 * (1 - (120 / 128) ** 8)
    read8 = 2 * (30_532_122_624 - 151936 * 2048 - 48 * (128 - touched) * 4_718_592)
    assert p.step_memory_bound_s == pytest.approx((read8 + 8 * kv_req) / 3.35e12)
    assert p.step_compute_bound_s == pytest.approx(2 * (3_353_032_704 - 151936 * 2048) * 8 / 989e12)
    assert p.flop_params == 3_353_032_704 - 151936 * 2048


def test_moe_compute_bound_crossover_equates_memory_and_compute() -> None:
    p = plan("qwen3-30b-a3b", "h100", context_len=16)
    b = p.compute_bound_from_batch
    assert b is not None and b > 8
    mem, comp = p.bounds(b)
    assert mem == pytest.approx(comp, rel=1e-6)
    # at ~3,175 rows every expert is read (128 (1 - (15/16)^3175) = 128): the dense formula with all
    # the experts' bytes and the active parameters' FLOPs
    k = 16 * p.kv_bytes_per_token_per_chip
    assert b == pytest.approx(p.streamed_weight_bytes_per_chip / (2 * p.flop_params * 3.35e12 / 989e12 - k))


def test_cli_prints_total_and_active_params(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_math_cli.main(["--model", "qwen3-30b-a3b", "--context", "8192"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "30.53B params" in out and "active params per token 3.35B (8 of 128 experts" in out
    assert "weights read per step" in out and "at batch 8" in out


def test_sliding_window_layers_count_at_their_window() -> None:
    """Gemma 3 270M's shape (18 layers, 5 local : 1 global, window 512, 1 KV head of 256): a
    32k-token request holds the 3 global layers' KV for every token and the 15 local layers'
    for their window's pages only (512 / 16 + 1 = 33 pages of 16 at most), by hand."""
    cfg = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "hidden_size": 640,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 2048,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    }
    m = ModelShape.from_hf_config(cfg)
    assert (m.sliding_window, m.num_local_layers) == (512, 15)
    per_layer_token = 2 * 256 * 2  # K and V, one head of 256, bf16
    assert kv_bytes_per_token(m) == 18 * per_layer_token
    assert km.local_pages_per_request(512, 16) == 33
    ctx = 32768
    assert km.kv_bytes_per_request(m, ctx, page_size=16) == per_layer_token * (3 * ctx + 15 * 33 * 16)
    assert km.kv_bytes_per_request(m, 300, page_size=16) == 18 * 304 * per_layer_token  # shorter than the window
    p = plan(m, "h100", context_len=ctx)
    assert p.kv_bytes_max_request_per_chip == per_layer_token * (3 * ctx + 15 * 33 * 16)
    assert p.max_concurrent_requests == p.kv_free_bytes_per_chip // p.kv_bytes_max_request_per_chip
    assert any("sliding window 512: 15 of 18 layers" in n for n in p.notes)
    mistral = ModelShape.from_hf_config({**cfg, "model_type": "mistral", "layer_types": None})
    assert mistral.num_local_layers == 18  # every layer slides
    qwen2 = ModelShape.from_hf_config({**cfg, "model_type": "qwen2", "layer_types": None})
    assert qwen2.num_local_layers == 0  # its window applies only with use_sliding_window
