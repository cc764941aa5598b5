"""Async scheduling (host work hidden behind the device) against the synchronous loop.

Two engines on the random 56.4M Llama of ../shared/workloads/mixed-64.json, identical but for
`async_scheduling`, run alternately in one process so machine drift hits both alike:

- batch 1: one request, prompt 512 tokens, 128 greedy tokens: time per output token;
- batch 16: 16 such requests with 64-token prompts at once: output tokens per second;
- mixed-64: the whole workload (as `jaxserve bench throughput --workload-file` runs it): output tokens per second.

Prints each round and the medians, the ratio async/sync, and checks the outputs are equal.

    .venv/bin/python scripts/bench_async.py [--rounds 5] [--workload F] [--skip-mixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jaxserve.tools.bench.workload import model_from_spec as build_model

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "mixed-64.json"


def run(llm, prompts, max_tokens) -> tuple[float, list[list[int]], int]:
    from jaxserve import SamplingParams

    llm.flush_prefix_cache()
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    seqs = [llm.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    for s in seqs:
        llm.submit(s)
    steps = 0
    t0 = time.perf_counter()
    while llm.has_unfinished():
        llm.step()
        steps += 1
    return time.perf_counter() - t0, [s.output_ids for s in seqs], steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    import numpy as np

    wl = json.loads(Path(args.workload).read_text())
    vocab = wl["model"]["vocab_size"]
    rng = np.random.default_rng(0)
    cases = {
        "batch1": ([rng.integers(3, vocab, 512).tolist()], [128]),
        "batch16": ([rng.integers(3, vocab, 64).tolist() for _ in range(16)], [128] * 16),
    }
    if not args.skip_mixed:
        cases["mixed64"] = ([r["prompt_ids"] for r in wl["requests"]], [r["output_len"] for r in wl["requests"]])
    with tempfile.TemporaryDirectory() as tmp:
        build_model(wl["model"], Path(tmp))
        from jaxserve import LLM

        engines = {name: LLM(tmp, async_scheduling=on) for name, on in (("async", True), ("sync", False))}
        for llm in engines.values():  # first use of every prefill bucket and batch size
            for prompts, outs in cases.values():
                run(llm, prompts[:4], [4] * len(prompts[:4]))
        from jaxserve.runner.executable_cache import compile_count

        compiles = compile_count()  # process-wide: taken after both engines are warm
        times = {(c, e): [] for c in cases for e in engines}
        outputs = {}
        for r in range(args.rounds):
            for case, (prompts, outs) in cases.items():
                for name in ("async", "sync") if r % 2 == 0 else ("sync", "async"):
                    secs, out, steps = run(engines[name], prompts, outs)
                    times[case, name].append(secs)
                    outputs.setdefault(case, {})[name] = out
                    per_tok = secs / max(outs) * 1e3 if case == "batch1" else None
                    print(
                        f"round {r} {case:8s} {name:5s}: {secs:.3f}s, {sum(outs) / secs:7.1f} tok/s"
                        + (f", {per_tok:.2f} ms/token" if per_tok else "")
                        + f", {steps} steps",
                        flush=True,
                    )
        results = {"rounds": args.rounds}
        for case, (prompts, outs) in cases.items():
            a, s = statistics.median(times[case, "async"]), statistics.median(times[case, "sync"])
            same = outputs[case]["async"] == outputs[case]["sync"]
            results[case] = dict(
                async_s=a,
                sync_s=s,
                speedup=s / a,
                outputs_equal=same,
                async_tok_s=sum(outs) / a,
                sync_tok_s=sum(outs) / s,
            )
            extra = f"; per token {a / max(outs) * 1e3:.2f} vs {s / max(outs) * 1e3:.2f} ms" if case == "batch1" else ""
            print(
                f"{case}: async {sum(outs) / a:.1f} tok/s, sync {sum(outs) / s:.1f} tok/s, "
                f"async/sync speed {s / a:.3f}x{extra}; outputs equal: {same}"
            )
        results["compiles_after_warmup"] = compile_count() - compiles
        results["overlapped_steps"] = engines["async"].core.overlapped_steps
        print(f"compiles after warm-up: {results['compiles_after_warmup']}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
