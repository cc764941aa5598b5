"""One ragged step of 16 decode rows plus a prompt chunk against the chunk alone.

    .venv/bin/python scripts/bench_step.py MODEL_DIR [--context 64] [--opts '{"max_num_batched_tokens": 512, "max_slots": 32}']

Runs `ModelRunner.step` directly (no scheduler) on pages of its own: 16 decode rows at
`--context`, a 256-token fresh chunk (272 tokens: the 512 bucket) and a 240-token one (with the
16 rows exactly the 256 bucket), each case alone and together, alternating the order each round;
prints medians and the ratios "rows + chunk / chunk alone".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from jaxserve import LLM
from jaxserve.runner.step_batch import Chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--opts", default='{"max_num_batched_tokens": 512, "max_slots": 32}')
    args = ap.parse_args()
    llm = LLM(args.model, **json.loads(args.opts))
    r = llm.runner
    per = args.context // r.cfg.page_size + 2

    def pages(i):
        return list(range(1 + i * per, 1 + (i + 1) * per))

    greedy = (0.0, 0, 1.0, 0, 0)
    dec = [Chunk([5], args.context, pages(i), greedy) for i in range(16)]
    c256 = Chunk(list(range(100, 356)), 0, pages(16) + pages(17), greedy)
    c240 = Chunk(list(range(100, 340)), 0, pages(16) + pages(17), greedy)
    cases = {
        "chunk 256": [c256],
        "16 decodes": dec,
        "16 decodes + chunk 256": dec + [c256],
        "chunk 240": [c240],
        "16 decodes + chunk 240": dec + [c240],
    }
    for rows in cases.values():
        r.step(rows)
    times = {k: [] for k in cases}
    for i in range(args.rounds):
        for k, rows in cases.items() if i % 2 == 0 else reversed(cases.items()):
            t0 = time.perf_counter()
            r.step(rows)
            jax.block_until_ready(r.kv)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>24}: {v:6.1f} ms")
    print(f"16 decodes + chunk 256 / chunk 256: {med['16 decodes + chunk 256'] / med['chunk 256']:.2f}x")
    print(f"16 decodes + chunk 240 / chunk 240: {med['16 decodes + chunk 240'] / med['chunk 240']:.2f}x")


if __name__ == "__main__":
    main()
