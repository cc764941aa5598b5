"""Batch-1 decode at context 512: jaxserve against llama.cpp on the same weights, side by side.

The model is the 56.4M bench Llama of ../shared/workloads/mixed-64.json (random weights,
torch.manual_seed(0), built by `jaxserve.tools.bench.workload.model_from_spec`), float32 on both
sides. Each round runs, one after another on the same cores:

  (a) llama.cpp: `llama-bench -m GGUF -p 0 -n N -d 512 -t 1,2 -fa 0,1 -ctk f32 -ctv f32 -r R
      -o json`: batch-1 generation of N tokens after a 512-token prefill (so contexts 512 to
      512 + N), float32 weights and KV cache, time per generated token (median of its R runs),
      for 1 and 2 threads with flash attention off and on; the fastest of the four is
      llama.cpp's time for the round (on a shared 2-core host, 2 threads spinning at llama.cpp's
      barriers can lose badly to 1 thread when other jobs hold a core);
  (b) jaxserve's jitted decode step at batch 1, every slot at context 512, the default
      (native) CPU attention: `jaxserve.tools.kv_math_cli.measure_engine_step` (its own random
      weights of the same shape: a float32 step's time does not depend on the values);
  (c) jaxserve end to end on the same checkpoint: `LLM(hf_dir, max_slots=1)`, one greedy
      request with a 512-token prompt, time per output token after the first (host work,
      scheduling and the sampled-id read-back included);
  (d) the memory-bandwidth bound: streamed weights (everything but the embedding table) plus
      512 tokens of KV, over the streaming bandwidth measured in the same round
      (`kv_math_cli.measure_host`: the faster of a numpy and a jitted jax sum over 512 MB).

Rounds alternate so load from other jobs hits every side alike; the summary is the median
over rounds and the ratio jaxserve / llama.cpp (target of issue #16: <= 1.2x).

Building llama.cpp (what was used on 2026-12-01; llama-cpp-python 0.3.36 vendors llama.cpp
with ggml 0.25.3; cmake 3.25, g++ 12):

    mkdir -p /work/llamacpp && cd /work/llamacpp
    pip download --no-deps --no-binary :all: llama-cpp-python -d .
    tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \\
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    # llama-bench parses only f16/bf16/quantized KV types: accept f32 too (one line)
    sed -i 's|^static ggml_type ggml_type_from_name(const std::string & s) {$|&\\n    if (s == "f32") return GGML_TYPE_F32;|' \\
        tools/llama-bench/llama-bench.cpp
    nice -n 19 cmake --build build -j2 --target llama-bench    # build/bin/llama-bench

Without that patch run with `--kv-type f16` (llama.cpp's default cache type: half the KV bytes,
about 2.5% of what a step reads here).

The GGUF (F32) comes from the vendored convert_hf_to_gguf.py, which this script runs with
`--make-gguf` (this venv is enough: the converter needs torch, transformers, numpy, pyyaml and
tqdm, and puts the vendored gguf-py on its own path):

    .venv/bin/python scripts/bench_llamacpp.py --make-gguf \\
        --llama-cpp-dir /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --hf-dir /work/llamacpp/bench-56m --gguf /work/llamacpp/bench-56m-f32.gguf

The bench checkpoint has a 32,000-token vocabulary but no tokenizer files, and the converter
refuses a Llama without one. `--make-gguf` therefore replaces LlamaModel.set_vocab, for this
conversion only, with the converter's own `_set_vocab_builtin("llama-spm", 32000)`: the Llama
SentencePiece vocabulary it ships as models/ggml-vocab-llama-spm.gguf (what the converter
does for OpenELM). The vocabulary size matches and no weight changes; llama-bench never
tokenizes text.

Then the comparison:

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_llamacpp.py \\
        --llama-bench /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench \\
        --gguf /work/llamacpp/bench-56m-f32.gguf --hf-dir /work/llamacpp/bench-56m [--rounds 5]

(or LLAMA_BENCH / LLAMA_GGUF / BENCH_HF_DIR in the environment instead of the flags).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO.parent / "shared" / "workloads" / "mixed-64.json"
GB = 1e9

# Run by --make-gguf in a subprocess: the vendored converter with the built-in Llama SPM vocab.
_CONVERT = """
import sys
llama_dir, hf_dir, out = sys.argv[1:4]
sys.path.insert(0, llama_dir)  # _set_vocab_builtin reads sys.path[0]/models
import convert_hf_to_gguf
from conversion.llama import LlamaModel
LlamaModel.set_vocab = lambda self: self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])
sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out]
convert_hf_to_gguf.main()
"""


def make_gguf(workload: Path, llama_cpp_dir: Path, hf_dir: Path, gguf: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from jaxserve.tools.bench.workload import model_from_spec as build_model

    spec = json.loads(workload.read_text())["model"]
    if not (hf_dir / "model.safetensors").exists():
        build_model(spec, hf_dir)
        print(f"built the bench checkpoint in {hf_dir}", flush=True)
    cmd = [sys.executable, "-c", _CONVERT, str(llama_cpp_dir), str(hf_dir), str(gguf)]
    subprocess.run(cmd, check=True, cwd=llama_cpp_dir)
    print(f"wrote {gguf}", flush=True)


# --------------------------------------------------------------------------- the sides
def run_llama_bench(exe: str, gguf: str, n_gen: int, depth: int, threads: str, kv_type: str, reps: int) -> dict:
    """Per-token ms of batch-1 generation after a `depth`-token prefill, for every thread count
    in `threads` and flash attention off and on: {"t2 fa0": ms, ...} (median of reps)."""
    cmd = [exe, "-m", gguf, "-p", "0", "-n", str(n_gen), "-d", str(depth), "-t", threads, "-fa", "0,1"]
    cmd += ["-ctk", kv_type, "-ctv", kv_type, "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = {}
    for row in json.loads(out):
        ms = statistics.median(s / row["n_gen"] / 1e6 for s in row["samples_ns"])
        res[f"t{row['n_threads']} fa{int(bool(row['flash_attn']))}"] = ms
    return res


def run_engine_step(shape, context: int, repeats: int) -> float:
    from jaxserve.tools.kv_math_cli import measure_engine_step

    return measure_engine_step(shape, 1, context, repeats=repeats) * 1e3


class EndToEnd:
    """LLM(hf_dir, max_slots=1): one greedy request, prompt of `context` tokens; ms per output
    token after the first (steady-state decode, host work included)."""

    def __init__(self, hf_dir: Path, context: int, n_gen: int, **options):
        import numpy as np

        from jaxserve import LLM

        self.llm = LLM(str(hf_dir), max_slots=1, max_model_len=1024, enable_prefix_caching=False, **options)
        self.attention_impl = self.llm.runner.attention_impl
        self.prompt = np.random.default_rng(0).integers(3, 32000, context).tolist()
        self.n_gen = n_gen

    def __call__(self) -> float:
        from jaxserve import SamplingParams

        sp = SamplingParams(max_tokens=self.n_gen + 1, temperature=0, ignore_eos=True)
        self.llm.submit(self.llm.make_sequence(self.prompt, sp))
        stamps, count = [], 0
        while self.llm.has_unfinished():
            for out in self.llm.step():
                if out.token_ids:
                    count += len(out.token_ids)
                    stamps.append((time.perf_counter(), count))
        (t0, c0), (t1, c1) = stamps[0], stamps[-1]
        return (t1 - t0) / (c1 - c0) * 1e3


def bandwidth_bound(shape, context: int) -> tuple[float, float]:
    """(ms, GB/s): streamed weights + `context` tokens of KV at batch 1 over the bandwidth measured now."""
    from jaxserve.kv_math import decode_step_bounds
    from jaxserve.tools.kv_math_cli import measure_host

    host = measure_host()
    bw = host["memory_bandwidth"]
    mem, _ = decode_step_bounds(shape, 1, context, bw, host["matmul_flops_fp32"], weight_dtype="fp32", kv_dtype="fp32")
    return mem * 1e3, bw / GB


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="path of llama-bench")
    ap.add_argument("--gguf", default=os.environ.get("LLAMA_GGUF"), help="the F32 GGUF of the bench model")
    ap.add_argument("--hf-dir", default=os.environ.get("BENCH_HF_DIR"), help="the HF checkpoint (for (c))")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--make-gguf", action="store_true", help="build the checkpoint and convert it, then exit")
    ap.add_argument("--llama-cpp-dir", help="the vendored llama.cpp source (for --make-gguf)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128, help="tokens llama-bench and the end-to-end run generate")
    ap.add_argument("--threads", default="1,2", help="llama-bench -t (a list: the fastest is llama.cpp's time)")
    ap.add_argument("--kv-type", default="f32", help="llama-bench -ctk/-ctv (f32 needs the one-line patch above)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench -r per round")
    ap.add_argument("--step-repeats", type=int, default=31, help="decode steps timed per round")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args(argv)

    if args.make_gguf:
        if not (args.llama_cpp_dir and args.hf_dir and args.gguf):
            ap.error("--make-gguf needs --llama-cpp-dir, --hf-dir and --gguf")
        make_gguf(Path(args.workload), Path(args.llama_cpp_dir), Path(args.hf_dir), Path(args.gguf))
        return 0
    if not (args.llama_bench and args.gguf):
        ap.error("--llama-bench and --gguf (or LLAMA_BENCH and LLAMA_GGUF) are required; see the top of this file")

    from jaxserve.kv_math import ModelShape

    spec = json.loads(Path(args.workload).read_text())["model"]
    shape = ModelShape.from_hf_config(spec)
    print(
        f"model: {shape.num_params / 1e6:.1f}M params ({shape.streamed_params / 1e6:.1f}M streamed per token), "
        f"context {args.context}, batch 1, float32, llama.cpp -t {args.threads}; load average {loadavg()}",
        flush=True,
    )
    e2e = None if args.skip_e2e or not args.hf_dir else EndToEnd(Path(args.hf_dir), args.context, args.n_gen)
    if e2e is not None:
        print(f"end to end: LLM(max_slots=1), attention {e2e.attention_impl}", flush=True)
        e2e()  # warm: first request pays one-off costs

    rounds = []
    for r in range(args.rounds):
        row = {"load_before": loadavg()}
        row["bound_ms"], row["bandwidth_gb_s"] = bandwidth_bound(shape, args.context)
        lb = run_llama_bench(
            args.llama_bench, args.gguf, args.n_gen, args.context, args.threads, args.kv_type, args.llama_reps
        )
        row["llama"] = lb
        row["llama_ms"] = min(lb.values())
        row["step_ms"] = run_engine_step(shape, args.context, args.step_repeats)
        if e2e is not None:
            row["e2e_ms"] = e2e()
        row["load_after"] = loadavg()
        rounds.append(row)
        print(
            f"round {r}: llama.cpp {row['llama_ms']:.2f} ms/token ("
            + ", ".join(f"{k} {v:.2f}" for k, v in lb.items())
            + f"), jaxserve step {row['step_ms']:.2f} ms"
            + (f", end to end {row['e2e_ms']:.2f} ms" if e2e is not None else "")
            + f"; bound {row['bound_ms']:.2f} ms at {row['bandwidth_gb_s']:.1f} GB/s; load {row['load_after']}",
            flush=True,
        )

    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k.endswith(("_ms", "_s"))}
    configs = {k: statistics.median(r["llama"][k] for r in rounds) for k in rounds[0]["llama"]}
    best_bw = max(r["bandwidth_gb_s"] for r in rounds)
    print(f"\nmedians over {len(rounds)} rounds (best bandwidth {best_bw:.1f} GB/s):")
    print(f"{'':34} {'ms/token':>9} {'/ llama.cpp':>12} {'/ bound':>8}")
    lines = [("memory bound (weights + KV / bw)", med["bound_ms"])]
    lines += [(f"llama.cpp -t{k[1:].replace(' fa', ' -fa ')}", ms) for k, ms in configs.items()]
    lines += [("llama.cpp (fastest, per round)", med["llama_ms"]), ("jaxserve decode step", med["step_ms"])]
    if "e2e_ms" in med:
        lines.append(("jaxserve LLM end to end", med["e2e_ms"]))
    for name, ms in lines:
        print(f"{name:34} {ms:>9.2f} {ms / med['llama_ms']:>11.2f}x {ms / med['bound_ms']:>7.2f}x")
    ratios = [r["step_ms"] / r["llama_ms"] for r in rounds]
    print(
        f"jaxserve step / llama.cpp: {med['step_ms'] / med['llama_ms']:.2f}x (per round: "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + "); target <= 1.2x"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
