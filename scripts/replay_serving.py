"""Replay the long-short serving load through `LLM.step` in this process, timing every step.

    .venv/bin/python scripts/replay_serving.py MODEL_DIR ['{"max_prefill_tokens_while_decoding": 64}'] [SEED]

The same arrivals as `jaxserve bench serve --workload long-short --rate 2` (Poisson, 48
requests, a quarter of the prompts 1,200-1,800 random ids, the rest 48-256, outputs 64-160,
greedy, EOS ignored), without HTTP: inter-token gaps and TTFT as a streaming client of the
engine would see them, plus what the steps carried. It separates the engine's tail from the
server's and the network's, and shows the host's own: decode-only steps' p99 against their
median. With async scheduling a `step()` call waits on the previous step's tokens, so each
call's time is booked to the plan before it.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from jaxserve import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1]
    opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    llm = LLM(model, **opts)
    vocab = llm.model_cfg.vocab_size
    reqs, t = [], 0.0
    for _ in range(48):
        t += rng.expovariate(2.0)
        n = rng.randint(1200, 1800) if rng.random() < 0.25 else rng.randint(48, 256)
        reqs.append((t, [rng.randrange(3, vocab) for _ in range(n)], rng.randint(64, 160)))

    plans = []
    schedule = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    steps, itl, ttft, sent, last = [], [], [], {}, {}
    t0, nxt = time.perf_counter(), 0
    while nxt < len(reqs) or llm.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt][0] <= now:
            params = SamplingParams(max_tokens=reqs[nxt][2], ignore_eos=True, temperature=0.0)
            sent[llm.add_request(reqs[nxt][1], params)] = time.perf_counter()
            nxt += 1
        if not llm.has_unfinished():
            time.sleep(max(0.0, reqs[nxt][0] - now))
            continue
        s0 = time.perf_counter()
        outs = llm.step()
        s1 = time.perf_counter()
        p = plans[-2] if len(plans) > 1 else plans[-1]
        steps.append((s1 - s0, sum(c.end - c.start for c in p.prefills)))
        for o in outs:
            (itl.append(s1 - last[o.request_id]) if o.request_id in last else ttft.append(s1 - sent[o.request_id]))
            last[o.request_id] = s1
    itl_ms, ttft_ms, st = np.array(itl) * 1e3, np.array(ttft) * 1e3, np.array(steps)
    p50, p99 = np.percentile(itl_ms, 50), np.percentile(itl_ms, 99)
    print(f"options {opts}: {llm.compiles_since_warmup()} compiles after warm-up")
    print(
        f"ITL p50 {p50:.1f} p99 {p99:.1f} max {itl_ms.max():.1f} ms ({p99 / p50:.2f}x); TTFT p50 {np.median(ttft_ms):.1f} ms"
    )
    for name, rows in (("decode-only", st[st[:, 1] == 0]), ("with prompt tokens", st[st[:, 1] > 0])):
        if len(rows):
            ms = rows[:, 0] * 1e3
            print(f"  {name} steps {len(rows)}: median {np.median(ms):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms")


if __name__ == "__main__":
    main()
