"""Decode steps with sampling on: greedy, temperature 1 (OpenAI's default), top-p, top-k.

    .venv/bin/python scripts/bench_sampling.py [MODEL_DIR] [--batch 4] [--steps 120]

Uses only the public `LLM` API, so it runs against any checkout (PYTHONPATH=that checkout) to
compare sampler versions side by side: `--batch` requests decode together (prompts of 256 ids,
EOS ignored; a random-weight model's flat rows send top-p to the sort fallback, a trained
model's do not) and each `LLM.step()` is timed; prints the median and p90 per setting. A step's
time includes reading back the previous step's tokens (async scheduling), as serving does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxserve import LLM, SamplingParams

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 50": dict(temperature=0.8, top_k=50),
}


def time_steps(llm: LLM, params: SamplingParams, batch: int, steps: int) -> list[float]:
    for i in range(batch):
        llm.add_request([100 + (7 * i + j) % 200 for j in range(256)], params)
    ts = []
    for _ in range(steps + 4):
        t0 = time.perf_counter()
        llm.step()
        ts.append(time.perf_counter() - t0)
    while llm.has_unfinished():
        llm.step()
    return ts[4:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="default: the shipped SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--opts", default="{}", help="LLM(...) options as JSON")
    args = ap.parse_args()
    llm = LLM(args.model, **json.loads(args.opts)) if args.model else LLM(**json.loads(args.opts))
    out = {}
    for name, kw in SETTINGS.items():
        params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, seed=0, **kw)
        ts = sorted(time_steps(llm, params, args.batch, args.steps))
        out[name] = (statistics.median(ts) * 1e3, ts[int(0.9 * len(ts))] * 1e3)
        print(f"{name:>14}: step median {out[name][0]:7.2f} ms, p90 {out[name][1]:7.2f} ms", flush=True)
    print(json.dumps({k: round(v[0], 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
