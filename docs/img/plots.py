"""Draws the plots of docs/benchmarks.md from the figures in its headline table.

The numbers below are the medians that page reports, each beside the command that measured it and
the host it ran on; nothing here measures. Rerun after editing a figure:

    python docs/img/plots.py        # writes docs/img/*.png next to this file
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parent
ZEN4 = "AMD EPYC Zen 4 (AVX512-BF16), 2 vCPU"
ZEN3 = "AMD EPYC Zen 3 (AVX2 only), 2 vCPU"

# jaxserve bench throughput --model ../shared/workloads/mixed-64.json --num-requests 48 --prompt-len 32-640
#   --output-len 8-200 --rounds 3 --engine-opts '{}' --engine-opts '{"dtype": "float32"}'
#   --vllm-python VLLM_PYTHON --vllm-opts '{"dtype": "bfloat16"}' --vllm-opts '{"dtype": "float32"}'   (ZEN4)
# the same with only --vllm-opts '{"dtype": "float32"}'   (ZEN3)
OFFLINE = {  # host: {(engine, dtype): output tok/s}
    "Zen 4, bfloat16": {"jaxserve": 905, "vLLM 0.32 CPU": 490},
    "Zen 4, float32": {"jaxserve": 519, "vLLM 0.32 CPU": 248},
    "Zen 3 (AVX2), float32": {"jaxserve": 370, "vLLM 0.32 CPU": 186},
}
# jaxserve bench throughput --random 32,128,32000 --num-requests 64 --prompt-len 16 --output-len 192 --rounds 3
#   --engine-opts '{}' --engine-opts '{"num_scheduler_steps": 8}' --vllm-python VLLM_PYTHON
#   --vllm-opts '{"dtype": "bfloat16"}'   (ZEN4): ms per step = a round's wall_s / 192
THIN_MS_PER_STEP = {"jaxserve\n(defaults)": 18.1, "jaxserve\n(8 steps a call)": 16.0, "vLLM 0.32\nCPU, bf16": 27.4}

# jaxserve kv-math --model ../shared/workloads/mixed-64.json --measure-host --kv-dtype bf16
#   --weight-dtype bf16 --context 512 --rounds 3   (ZEN4, 2026-12-05): ms per decode step
DECODE_MS = {1: 3.39, 8: 5.28, 32: 16.44}
ROOFLINE_MS_B32 = 6.19

# jaxserve bench speculative --prompts edit|chat [--batch 8 --num-requests 16] --k 7 --fixed-k 4
#   --rounds 2   (SmolLM2-135M, bfloat16; ZEN4, 2026-12-07): speedup over plain decoding
SPEC_ADAPTIVE = {
    "edit, batch 1": (1.59, 1.60),
    "chat, batch 1": (1.14, 1.22),
    "edit, batch 8": (1.16, 1.17),
    "chat, batch 8": (0.96, 0.96),
}  # (adaptive, fixed k=4)
# jaxserve bench speculative --prompts code|chat --k 3 --rounds 3   (float32; ZEN3, 2026-12-05)
SPEC_NGRAM_AVX2 = {"code, batch 1": 2.04, "chat, batch 1": 1.04, "code, batch 8": 1.02}

# jaxserve bench serve --base-url http://127.0.0.1:8123 --base-url http://127.0.0.1:8124 --rate 2
#   --num-requests 48 --workload long-short --vocab-size 32000 --rounds 2, against jaxserve serve
#   [--max-prefill-tokens-while-decoding 16] and vLLM's server (docs/benchmarks.md, "jaxserve beside vLLM")
#   (the 56.4M Llama; ZEN4), ms
SERVING = {  # metric: {config: ms}
    "TTFT p50": {"jaxserve cap 64": 49.4, "vLLM": 54.6, "jaxserve cap 16": 140.7, "vLLM ": 199.4},
    "ITL p50": {"jaxserve cap 64": 4.9, "vLLM": 10.8, "jaxserve cap 16": 8.1, "vLLM ": 15.1},
    "ITL p99": {"jaxserve cap 64": 20.3, "vLLM": 46.0, "jaxserve cap 16": 16.9, "vLLM ": 169.5},
}

JAX_C, VLLM_C, ALT_C = "#3465a4", "#cc6633", "#73a0d0"


def bars(ax, labels, values, colors):
    """Bars with their values printed on top."""
    xs = range(len(values))
    ax.bar(xs, values, color=colors)
    ax.set_xticks(list(xs), labels)
    for x, v in zip(xs, values):
        ax.annotate(f"{v:g}", (x, v), ha="center", va="bottom", fontsize=8)


def offline():
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for i, (host, row) in enumerate(OFFLINE.items()):
        for j, (engine, v) in enumerate(row.items()):
            x = i + (j - 0.5) * width
            a.bar(x, v, width, color=JAX_C if j == 0 else VLLM_C, label=engine if i == 0 else None)
            a.annotate(f"{v}", (x, v), ha="center", va="bottom", fontsize=8)
    a.set_xticks(range(len(OFFLINE)), list(OFFLINE))
    a.set_ylabel("output tokens/s")
    a.set_title("Offline mixed-64, 56.4M Llama", fontsize=10)
    a.legend(fontsize=8)
    bars(b, list(THIN_MS_PER_STEP), list(THIN_MS_PER_STEP.values()), [JAX_C, ALT_C, VLLM_C])
    b.set_ylabel("ms per decode step (lower is better)")
    b.set_title("64 rows, thin 32-layer Llama, Zen 4", fontsize=10)
    b.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "offline-vs-vllm.png", dpi=90)


def decode_by_batch():
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    rows = list(DECODE_MS)
    tok_s = [r * 1000 / DECODE_MS[r] for r in rows]
    ax.plot(rows, tok_s, "o-", color=JAX_C, label="measured (bfloat16 weights and KV)")
    ax.plot([32], [32 * 1000 / ROOFLINE_MS_B32], "x", color="gray", label="memory roofline at 32 rows")
    for r, t in zip(rows, tok_s):
        ax.annotate(
            f"{t:.0f} tok/s\n{DECODE_MS[r]} ms", (r, t), textcoords="offset points", xytext=(6, -18), fontsize=8
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.set_xlabel("decode rows in the step (batch)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Decode step, 56.4M Llama, context 512\n{ZEN4}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(OUT / "decode-by-batch.png", dpi=90)


def speculative():
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [4, 3]})
    width = 0.38
    for i, (adaptive, fixed) in enumerate(SPEC_ADAPTIVE.values()):
        a.bar(i - width / 2, adaptive, width, color=JAX_C, label="adaptive (k <= 7)" if i == 0 else None)
        a.bar(i + width / 2, fixed, width, color=ALT_C, label="fixed k = 4" if i == 0 else None)
        a.annotate(f"{adaptive:g}x", (i - width / 2, adaptive), ha="center", va="bottom", fontsize=8)
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xticks(range(len(SPEC_ADAPTIVE)), list(SPEC_ADAPTIVE), fontsize=8)
    a.set_ylabel("speedup over plain decoding")
    a.set_title("Prompt lookup, SmolLM2-135M bf16, Zen 4", fontsize=10)
    a.legend(fontsize=8)
    bars(b, list(SPEC_NGRAM_AVX2), list(SPEC_NGRAM_AVX2.values()), JAX_C)
    b.axhline(1.0, color="gray", lw=0.8)
    b.tick_params(axis="x", labelsize=8)
    b.set_title("Prompt lookup k = 3, SmolLM2 float32, Zen 3", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "speculative-speedup.png", dpi=90)


def serving():
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.2))
    for ax, (metric, row) in zip(axes, SERVING.items()):
        labels = [k.strip().replace("jaxserve ", "jaxserve\n") for k in row]
        bars(ax, labels, list(row.values()), [JAX_C, VLLM_C, ALT_C, VLLM_C])
        ax.set_title(metric + " (ms, lower is better)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        "Serving the long-short mix at 2 req/s, 56.4M Llama, Zen 4: each jaxserve bar, then the vLLM 0.32 CPU"
        " (bf16) run beside it",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(OUT / "serving-vs-vllm.png", dpi=90)


if __name__ == "__main__":
    offline()
    decode_by_batch()
    speculative()
    serving()
