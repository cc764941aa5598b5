"""Prefix caching: 64 requests sharing a 1,024-token prefix, caching on and off in one run.

Each request is the shared prefix + 32 unique tokens and generates 32 tokens (greedy, no
EOS). All 64 arrive at once; TTFT is measured from submission to the first token. Uses the
random Llama of ../shared/workloads/mixed-64.json (56M parameters), float32 on the CPU.

    .venv/bin/python scripts/bench_prefix.py [--requests 64] [--prefix 1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import DEFAULT_WORKLOAD, build_model  # noqa: E402


def run(llm, prompts, out_len: int) -> dict:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    tokens = 0
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    while llm.has_unfinished():
        for o in llm.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            tokens += len(o.token_ids)
            outputs[o.request_id] += o.token_ids
    wall = time.perf_counter() - t0
    ttft = np.array([first[i] for i in ids])
    return {
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "req_s": len(ids) / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "outputs": [outputs[i] for i in ids],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="only its model spec is used")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--unique", type=int, default=32)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--max-slots", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.workload).read_text())["model"]
    rng = np.random.default_rng(0)
    prefix = [int(x) for x in rng.integers(3, spec["vocab_size"], args.prefix)]
    prompts = [
        prefix + [int(x) for x in rng.integers(3, spec["vocab_size"], args.unique)] for _ in range(args.requests)
    ]
    from jaxserve import LLM

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(spec, Path(tmp))
        max_len = args.prefix + args.unique + args.output + 16
        for name, on in (("caching_on", True), ("caching_off", False)):
            llm = LLM(tmp, max_slots=args.max_slots, page_size=16, max_model_len=max_len, enable_prefix_caching=on)
            results[name] = run(llm, prompts, args.output)
            if on:
                results[name]["hit_rate"] = llm.prefix_cache.hit_rate
            r = results[name]
            print(
                f"{name}: TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s, "
                f"{r['output_tok_s']:.1f} output tok/s, {r['req_s']:.2f} req/s, wall {r['wall_s']:.1f}s",
                flush=True,
            )
            del llm
    on, off = results["caching_on"], results["caching_off"]
    same = sum(a == b for a, b in zip(on.pop("outputs"), off.pop("outputs")))
    summary = {
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"],
        "throughput_speedup": on["output_tok_s"] / off["output_tok_s"],
        "identical_outputs": f"{same}/{len(prompts)}",
    }
    results["summary"] = summary
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
