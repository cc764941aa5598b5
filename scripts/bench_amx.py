"""bfloat16 (AMX tiles or AVX512-BF16 dot products) against float32, side by side in one process.

Configurations take turns round after round (the machine is shared: its load hits both alike)
and medians are reported, as ratios first:

1. a large square matmul (``--square``, default 2048): the native kernel on float32 panels and
   on bfloat16 (AMX tiles or AVX512-BF16), GFLOP/s;
2. the prefill of a ``--prompt``-token prompt (default 2,048) on the 56.4M bench model of
   ../shared/workloads/mixed-64.json (random weights; max_position_embeddings raised so that the
   prompt and one token fit) through ``LLM`` (prompt chunks of the token budget, 256 on the CPU), prefix
   caching off, a fresh prompt every round; GFLOP/s of its projections (2 x 23.6M x tokens:
   attention's share of the time counted against it);
3. the decode step alone at batch 1 and 32, every slot at ``--context`` tokens (kv-math's
   ``decode_step_runner``, timed as the engine runs steps), beside its memory bound: the bytes
   it must read (weights but the embedding table, live KV) over a streaming read taken just
   before each timing;
4. the mixed-64 workload offline with ``LLM(path)`` defaults against ``dtype="float32"`` (as
   `jaxserve bench throughput --workload-file mixed-64.json --model workload`: every run cold, prefix cache flushed): useful output
   tokens per second, and how many outputs equal float32's.

Throughout, "bfloat16" is ``LLM(path)``'s defaults on such a host (bfloat16 weights and KV pages)
and "float32" is ``dtype="float32"`` (today's exact float32 path); the decode steps use the same
weights and pages.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_amx.py [--rounds 5] [--json F]
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
DEFAULT_WORKLOAD = REPO.parent / "shared" / "workloads" / "mixed-64.json"
DTYPES = ("float32", "bfloat16")


def bench_square(n: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import native_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
    w = rng.standard_normal((n, n)).astype(np.float32)
    panels = {"float32": jnp.asarray(native_matmul.pack(w)), "bfloat16": jnp.asarray(native_matmul.pack_bf16(w))}
    f = jax.jit(native_matmul.matmul, static_argnames="n")
    for p in panels.values():
        f(x, p, n=n).block_until_ready()
    times = {d: [] for d in DTYPES}
    for _ in range(rounds):
        for d, p in panels.items():
            t0 = time.perf_counter()
            f(x, p, n=n).block_until_ready()
            times[d].append(time.perf_counter() - t0)
    return {
        d: {"median_s": statistics.median(t), "gflops": 2 * n**3 / statistics.median(t) / 1e9} for d, t in times.items()
    }


# "bfloat16" is LLM(path)'s defaults on a host with AMX or AVX512-BF16 (bfloat16 weights and KV
# pages); "float32" is dtype="float32", the exact float32 path (float32 weights and pages).
ENGINE_OPTS = {"float32": {"dtype": "float32"}, "bfloat16": {}}
KV = {"float32": "auto", "bfloat16": "bfloat16"}


def bench_prefill(spec: dict, prompt: int, rounds: int) -> dict:
    import numpy as np
    from transformers import LlamaForCausalLM

    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.executable_cache import compile_count
    from jaxserve.tools.bench.workload import model_from_spec

    spec = {**spec, "max_position_embeddings": max(spec["max_position_embeddings"], prompt + 64)}
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    times = {d: [] for d in DTYPES}
    first = {d: [] for d in DTYPES}
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaForCausalLM.from_pretrained(model_from_spec(spec, Path(tmp)))
        layer_params = sum(
            p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n
        )
        del model
        engines = {
            d: LLM(tmp, **ENGINE_OPTS[d], max_slots=1, max_model_len=prompt + 16, enable_prefix_caching=False)
            for d in DTYPES
        }
        before = compile_count()  # process-wide: both engines are warm by now
        for _ in range(rounds):
            toks = [int(t) for t in rng.integers(1, spec["vocab_size"], prompt)]  # fresh every round
            for d, llm in engines.items():
                t0 = time.perf_counter()
                out = llm.generate([toks], [params])
                times[d].append(time.perf_counter() - t0)
                first[d].append(out[0].token_ids[0])
        compiles = compile_count() - before
    flops = 2 * layer_params * prompt
    return {
        "prompt_tokens": prompt,
        "projection_flops": flops,
        "first_tokens_equal": sum(a == b for a, b in zip(first["float32"], first["bfloat16"])),
        "rounds": rounds,
        "compiles_after_warmup": compiles,
        **{
            d: {"median_s": statistics.median(t), "runs_s": t, "projection_gflops": flops / statistics.median(t) / 1e9}
            for d, t in times.items()
        },
    }


def bench_decode(spec: dict, batches, context: int, rounds: int, repeats: int) -> dict:
    from bench_quant import step_bytes

    from jaxserve.tools.kv_math_cli import bandwidth_probe, decode_step_runner, resolve_model, time_overlapped_steps

    shape = resolve_model(str(DEFAULT_WORKLOAD))
    probe = bandwidth_probe()
    out = {}
    for b in batches:
        runners = {}
        for d in DTYPES:
            runner, rows = decode_step_runner(shape, b, context, matmul_dtype=d, kv_cache_dtype=KV[d])
            runner.decode(rows, 0)  # compile
            runners[d] = (runner, rows, step_bytes(runner, b, context))
        times = {d: [] for d in DTYPES}
        ratios = {d: [] for d in DTYPES}
        for _ in range(rounds):
            for d, (runner, rows, nbytes) in runners.items():
                bw = probe()
                t = time_overlapped_steps(runner, rows, repeats)
                times[d].append(t)
                ratios[d].append(t / (nbytes / bw))
        out[f"b{b}"] = {
            d: {
                "median_s": statistics.median(times[d]),
                "bytes": runners[d][2],
                "over_memory_bound": statistics.median(ratios[d]),
            }
            for d in DTYPES
        }
        del runners
    return out


def run_jaxserve(llm, reqs):
    """The workload's requests on llm (jaxserve bench's offline driver): (wall s, output ids)."""
    from jaxserve.tools.bench.offline import run_offline
    from jaxserve.tools.bench.workload import Request

    rs = run_offline(llm, [Request(r["prompt_ids"], r["output_len"]) for r in reqs])
    return rs.wall_s, rs.outputs


def bench_workload(wl: dict, rounds: int) -> dict:
    from jaxserve import LLM
    from jaxserve.runner.executable_cache import compile_count
    from jaxserve.tools.bench.workload import model_from_spec

    reqs = wl["requests"]
    useful = sum(r["output_len"] for r in reqs)
    times = {d: [] for d in DTYPES}
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_from_spec(wl["model"], Path(tmp))
        engines = {d: LLM(tmp, **ENGINE_OPTS[d]) for d in DTYPES}
        before = compile_count()
        for _ in range(rounds):
            for d, llm in engines.items():
                secs, toks = run_jaxserve(llm, reqs)
                times[d].append(secs)
                outs[d] = toks
        compiles = compile_count() - before
    return {
        "requests": len(reqs),
        "useful_tokens": useful,
        "identical_outputs": sum(a == b for a, b in zip(outs["float32"], outs["bfloat16"])),
        "compiles_after_warmup": compiles,
        **{d: {"median_s": statistics.median(t), "tok_s": useful / statistics.median(t)} for d, t in times.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--square", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10, help="decode steps per timing")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: square,prefill,decode,workload")
    ap.add_argument("--workload-rounds", type=int, default=2)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)

    from pallas_kernels import native, native_matmul

    if not native_matmul.bf16_available():
        print(f"bfloat16 matmul unavailable: {native_matmul.bf16_unavailable_reason()}")
        return 1
    skip = set(args.skip.split(","))
    wl = json.loads(Path(args.workload).read_text())
    spec = wl["model"]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds}
    if "square" not in skip:
        sq = res["square"] = bench_square(args.square, args.rounds)
        n = args.square
        print(
            f"square {n}x{n}x{n}: float32 {sq['float32']['gflops']:.0f} GFLOP/s, bfloat16 ({native.cpu_isa()}) "
            f"{sq['bfloat16']['gflops']:.0f} GFLOP/s: {sq['bfloat16']['gflops'] / sq['float32']['gflops']:.2f}x",
            flush=True,
        )
    if "prefill" not in skip:
        pf = res["prefill"] = bench_prefill(spec, args.prompt, args.rounds)
        f, b = pf["float32"], pf["bfloat16"]
        print(
            f"prefill {args.prompt} tokens: float32 {f['median_s'] * 1e3:.0f} ms ({f['projection_gflops']:.0f} GFLOP/s "
            f"of projections), bfloat16 {b['median_s'] * 1e3:.0f} ms ({b['projection_gflops']:.0f}): "
            f"{f['median_s'] / b['median_s']:.2f}x faster; first tokens equal {pf['first_tokens_equal']}/{args.rounds}; "
            f"compiles after warm-up {pf['compiles_after_warmup']}",
            flush=True,
        )
    if "decode" not in skip:
        dec = res["decode"] = bench_decode(spec, (1, 32), args.context, args.rounds, args.repeats)
        for key, v in dec.items():
            f, b = v["float32"], v["bfloat16"]
            print(
                f"decode {key} context {args.context}: float32 {f['median_s'] * 1e3:.2f} ms "
                f"({f['over_memory_bound']:.2f}x its memory bound, {f['bytes'] / 2**20:.0f} MiB), bfloat16 "
                f"{b['median_s'] * 1e3:.2f} ms ({b['over_memory_bound']:.2f}x, {b['bytes'] / 2**20:.0f} MiB): "
                f"{f['median_s'] / b['median_s']:.2f}x faster",
                flush=True,
            )
    if "workload" not in skip:
        w = res["workload"] = bench_workload(wl, args.workload_rounds)
        print(
            f"mixed workload ({w['requests']} requests, LLM(path) defaults): float32 {w['float32']['tok_s']:.0f} tok/s, "
            f"bfloat16 {w['bfloat16']['tok_s']:.0f} tok/s: {w['bfloat16']['tok_s'] / w['float32']['tok_s']:.2f}x; "
            f"outputs equal to float32's {w['identical_outputs']}/{w['requests']}; compiles after warm-up "
            f"{w['compiles_after_warmup']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
