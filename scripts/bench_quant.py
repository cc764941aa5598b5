"""Quantization speed, side by side in one run: full precision, int8 weights, int8 KV cache, both.

On the 56.4M bench model of ../shared/workloads/mixed-64.json (random weights, float32):

1. the jitted decode step alone (like ``jaxserve.tools.kv_math_cli.measure_engine_step``), at
   batch 1 and 16, every slot at ``--context`` tokens; configurations take turns, repeat after
   repeat, and each median is printed beside its memory bound (bytes the step must read over
   the streaming bandwidth measured in the same run, before and after);
2. the mixed workload offline (like `jaxserve bench throughput`): useful output tokens per second,
   configurations taking turns;
3. with ``--matmul``: one projection alone over row counts, XLA's float32 dot against the native
   kernel on float32 and int8 panels (and, on a CPU with AMX or AVX512-BF16, bfloat16 panels and
   int8 widened to bfloat16) and XLA's dequantize-then-dot, beside the streaming bound.

``--configs fp32,bf16,int8-weights,int8-bf16`` compares the matmul precisions on such a CPU.

The int8 KV cache runs only where ``EngineConfig`` has ``kv_cache_dtype``.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_quant.py [--repeats 5] [--skip-workload] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
DEFAULT_WORKLOAD = REPO.parent / "shared" / "workloads" / "mixed-64.json"

CONFIGS = {  # name -> (quantization, kv_cache_dtype, matmul_dtype)
    "fp32": (None, None, "float32"),
    "int8-weights": ("int8", None, "float32"),
    "int8-kv": (None, "int8", "float32"),
    "both": ("int8", "int8", "float32"),
    # on a CPU with AMX or AVX512-BF16 (--configs to pick them): bfloat16 weights, and int8
    # weights widened to bfloat16 in the kernel (W8A16: LLM(path, quantization="int8")'s default there)
    "bf16": (None, None, "bfloat16"),
    "int8-bf16": ("int8", None, "bfloat16"),
}
DEFAULT_CONFIGS = ("fp32", "int8-weights", "int8-kv", "both")


def engine_options(quant, kv, matmul_dtype="float32") -> dict:
    return {"quantization": quant, "kv_cache_dtype": kv or "auto", "matmul_dtype": matmul_dtype}


def step_bytes(runner, batch: int, context: int) -> int:
    """What one decode step must read: every parameter but the embedding table (one row per
    token), and the live KV of every row (pages and, for an 8-bit cache, their scales)."""
    import jax
    from flax import nnx

    t = runner.target
    params = nnx.to_flat_state(t.state)
    weights = sum(v.get_value().nbytes for p, v in params if str(p[0]) != "embed_tokens")
    kv_total = sum(x.nbytes for x in jax.tree.leaves(t.kv))
    num_pages = jax.tree.leaves(t.kv)[0].shape[0]
    page_size = jax.tree.leaves(t.kv)[0].shape[1]
    return weights + kv_total * batch * context // (num_pages * page_size)


class StepTimer:
    """One jitted decode step of a random-weight model, every slot at `context` tokens
    (kv-math's `decode_step_runner`: the step `jaxserve kv-math --measure-host` times)."""

    def __init__(self, shape, batch: int, context: int, quant, kv, matmul_dtype="float32"):
        from jaxserve.tools.kv_math_cli import decode_step_runner

        self.runner, self.rows = decode_step_runner(
            shape, batch, context, kv_cache_dtype=kv or "auto", quantization=quant, matmul_dtype=matmul_dtype
        )
        self.bytes = step_bytes(self.runner, batch, context)
        self.time()  # compile

    def time(self) -> float:
        import jax

        t0 = time.perf_counter()
        self.runner.decode(self.rows, 0)
        jax.block_until_ready(self.runner.kv)
        return time.perf_counter() - t0


def bandwidth(size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Streaming read rate now: a jitted sum over size_bytes, best of repeats (bytes/s)."""
    from jaxserve.tools.kv_math_cli import bandwidth_probe

    return bandwidth_probe(size_bytes, repeats)()


def bench_steps(shape, configs, batches, context, repeats, steps_per_repeat) -> dict:
    bw_before = bandwidth()
    out = {}
    for b in batches:
        timers = {name: StepTimer(shape, b, context, *CONFIGS[name]) for name in configs}
        times = {name: [] for name in configs}
        for _ in range(repeats):  # take turns: the shared machine's load hits every config alike
            for name, t in timers.items():
                times[name].append(min(t.time() for _ in range(steps_per_repeat)))
        for name in configs:
            out[f"{name}/b{b}"] = {
                "median_s": statistics.median(times[name]),
                "runs_s": times[name],
                "bytes": timers[name].bytes,
            }
        del timers
    bw_after = bandwidth()
    bw = max(bw_before, bw_after)
    for v in out.values():
        v["bound_s"] = v["bytes"] / bw
    return {"steps": out, "bandwidth_before": bw_before, "bandwidth_after": bw_after}


def run_jaxserve(llm, reqs):
    """The workload's requests on llm (jaxserve bench's offline driver): (wall s, output ids)."""
    from jaxserve.tools.bench.offline import run_offline
    from jaxserve.tools.bench.workload import Request

    rs = run_offline(llm, [Request(r["prompt_ids"], r["output_len"]) for r in reqs])
    return rs.wall_s, rs.outputs


def bench_workload(wl, configs, repeats, max_slots) -> dict:
    from jaxserve import LLM
    from jaxserve.tools.bench.workload import model_from_spec

    reqs = wl["requests"]
    useful = sum(r["output_len"] for r in reqs)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_from_spec(wl["model"], Path(tmp))
        engines = {}
        for name in configs:
            engines[name] = LLM(
                tmp, max_slots=max_slots, page_size=16, max_model_len=1024, **engine_options(*CONFIGS[name])
            )
        from jaxserve.runner.executable_cache import compile_count

        times = {name: [] for name in configs}
        outputs = {}
        before = compile_count()  # process-wide: every engine is warm by now
        for i in range(repeats):
            for name, llm in engines.items():
                secs, toks = run_jaxserve(llm, reqs)
                times[name].append(secs)
                outputs[name] = toks
                print(f"  workload {name} run {i}: {secs:.2f}s, {useful / secs:.0f} tok/s", flush=True)
        out["compiles_during_runs"] = compile_count() - before
        for name, llm in engines.items():
            med = statistics.median(times[name])
            same = sum(a == b for a, b in zip(outputs[name], outputs[configs[0]]))
            out[name] = {
                "median_s": med,
                "tok_s": useful / med,
                "runs_s": times[name],
                "compiles_after_warmup": llm.compiles_since_warmup(),
                f"greedy_equal_to_{configs[0]}": f"{same}/{len(reqs)}",
            }
    return out


def bench_matmul(rows_list, shapes, repeats) -> dict:
    """One projection alone, several ways taking turns: XLA's float32 dot, the native kernel on
    float32 panels, the native kernel on int8 panels, XLA's dequantize-then-dot (the TPU/GPU and
    tensor-parallel form) and, on a CPU with AMX or AVX512-BF16, the native kernel on bfloat16
    panels and on int8 panels for those units (W8A16). Each beside the time to stream its
    weights once at the bandwidth measured before the table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models import quantization
    from pallas_kernels import native_matmul as nm

    bw = bandwidth()
    print(f"  streaming read {bw / 1e9:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    out = {"bandwidth": bw}
    for k, n in shapes:
        wf = rng.standard_normal((k, n)).astype(np.float32)
        q, s = quantization.quantize_int8(wf.T)
        pf, (pq, ps) = nm.pack(wf), nm.pack_int8(q, s)
        bf16 = nm.bf16_available()
        if bf16:
            pb, (pqb, psb) = jnp.asarray(nm.pack_bf16(wf)), map(jnp.asarray, nm.pack_int8_bf16(q, s))
        wf, q, s, pf, pq, ps = map(jnp.asarray, (wf, q, s, pf, pq, ps))
        native = jax.jit(lambda x, w, sc=None: nm.matmul(x, w, sc, n=n))
        fns = {
            "xla-f32": (jax.jit(lambda x, w: x @ w), (wf,), 4),
            "native-f32": (native, (pf,), 4),
            "native-int8": (native, (pq, ps), 1),
            "xla-int8": (jax.jit(quantization.int8_matmul), (q, s), 1),
        }
        if bf16:  # the bfloat16 units: bfloat16 weights, int8 widened to bfloat16 (W8A16)
            fns["native-bf16"] = (native, (pb,), 2)
            fns["native-int8-bf16"] = (native, (pqb, psb), 1)
        for m in rows_list:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            times = {name: [] for name in fns}
            for f, a, _ in fns.values():
                f(x, *a).block_until_ready()
            for _ in range(repeats):
                for name, (f, a, _) in fns.items():
                    t0 = time.perf_counter()
                    f(x, *a).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            row = {name: statistics.median(v) for name, v in times.items()}
            row["bound_f32"], row["bound_int8"] = 4 * k * n / bw, k * n / bw
            out[f"{k}x{n}/m{m}"] = row
            print(
                f"  [{m:>3}, {k}] x [{k}, {n}]: "
                + ", ".join(f"{name} {row[name] * 1e3:.3f} ms" for name in fns)
                + f"  (bound f32 {row['bound_f32'] * 1e3:.3f}, int8 {row['bound_int8'] * 1e3:.3f} ms)",
                flush=True,
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=7, help="turns per configuration (median reported)")
    ap.add_argument("--steps-per-repeat", type=int, default=3, help="steps per turn (fastest kept)")
    ap.add_argument("--workload-repeats", type=int, default=2)
    ap.add_argument("--max-slots", type=int, default=64)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--matmul", action="store_true", help="also time one projection alone over row counts")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)

    import jax

    from pallas_kernels import native_matmul

    wl = json.loads(Path(args.workload).read_text())
    configs = [c for c in args.configs.split(",") if c]
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "backend": jax.default_backend(),
        "native_matmul": native_matmul.available(),
        "configs": configs,
    }
    if args.matmul:
        rows = [1, 4, 8, 16, 32, 64, 128, 256]
        shapes = [(512, 1408), (1408, 512), (512, 32000)]
        results["matmul"] = bench_matmul(rows, shapes, max(3, args.repeats))
    if not args.skip_steps:
        batches = [int(b) for b in args.batches.split(",")]
        from jaxserve.kv_math import resolve_model

        r = bench_steps(
            resolve_model(args.workload), configs, batches, args.context, args.repeats, args.steps_per_repeat
        )
        results.update(r)
        print(
            f"decode step, context {args.context}, bandwidth {r['bandwidth_before'] / 1e9:.1f} GB/s before, "
            f"{r['bandwidth_after'] / 1e9:.1f} GB/s after",
            flush=True,
        )
        for b in batches:
            base = r["steps"][f"{configs[0]}/b{b}"]["median_s"]
            for name in configs:
                v = r["steps"][f"{name}/b{b}"]
                print(
                    f"  batch {b:2d} {name:13s} {v['median_s'] * 1e3:7.2f} ms  (bound {v['bound_s'] * 1e3:6.2f} ms, "
                    f"{v['bytes'] / 1e6:6.1f} MB)  {base / v['median_s']:.2f}x {configs[0]}",
                    flush=True,
                )
    if not args.skip_workload:
        r = bench_workload(wl, configs, args.workload_repeats, args.max_slots)
        results["workload"] = r
        base = r[configs[0]]["tok_s"]
        for name in configs:
            v = r[name]
            print(
                f"  mixed-64 {name:13s} {v['tok_s']:6.0f} tok/s  {v['tok_s'] / base:.2f}x {configs[0]}  "
                f"greedy outputs equal to {configs[0]}'s: {v[f'greedy_equal_to_{configs[0]}']}",
                flush=True,
            )
        print(f"  compiles during the runs (all engines, after every warm-up): {r['compiles_during_runs']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
