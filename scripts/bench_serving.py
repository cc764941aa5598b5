"""Online serving: Poisson arrivals at several request rates against a running jaxserve.

A seeded ShareGPT-like mix of lengths (log-normal prompt and output lengths, clipped)
is sent over gRPC at each rate; per request we record TTFT, TPOT and the gaps between
streamed messages (inter-token latency). Reports p50/p90/p99, request and token throughput
and goodput (requests per second that met the latency targets), and plots latency against
rate. Starts its own server on the default model unless --target is given.

    .venv/bin/python scripts/bench_serving.py [--rates 1 2 4 8] [--requests 40] [--target HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def sharegpt_like(n: int, vocab: int, seed: int, max_len: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    plen = np.clip(rng.lognormal(4.6, 0.9, n).astype(int), 4, max_len // 2)  # median ~100 tokens
    olen = np.clip(rng.lognormal(4.2, 0.8, n).astype(int), 4, max_len // 4)  # median ~65 tokens
    return [([int(x) for x in rng.integers(3, vocab, p)], int(o)) for p, o in zip(plen, olen)]


def run_rate(target: str, reqs, rate: float, seed: int) -> dict:
    from jaxserve.serving.client import Client

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(reqs))
    results: list[dict | None] = [None] * len(reqs)

    def one(i: int, prompt: list[int], out_len: int) -> None:
        c = Client(target)
        t0 = time.perf_counter()
        times, n = [], 0
        try:
            for r in c.generate(prompt, max_tokens=out_len, temperature=0, ignore_eos=True):
                if r.token_ids:
                    times.append(time.perf_counter())
                    n += len(r.token_ids)
        finally:
            c.close()
        end = time.perf_counter()
        results[i] = {
            "ttft": times[0] - t0,
            "e2e": end - t0,
            "tokens": n,
            "tpot": (times[-1] - times[0]) / max(n - 1, 1),
            "itl": list(np.diff(times)),
        }

    threads = []
    start = time.perf_counter()
    for i, ((prompt, out_len), gap) in enumerate(zip(reqs, gaps)):
        time.sleep(gap)
        t = threading.Thread(target=one, args=(i, prompt, out_len))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r]
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    return {
        "rate": rate,
        "wall_s": wall,
        "completed": len(ok),
        "req_s": len(ok) / wall,
        "output_tok_s": sum(r["tokens"] for r in ok) / wall,
        **{f"ttft_p{q}": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}": pct(tpot, q) for q in (50, 90, 99)},
        **{f"itl_p{q}": pct(itl, q) for q in (50, 90, 99)},
        "_per_request": ok,
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--max-slots", str(args.max_slots)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        m = re.search(r"serving on ([\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("server did not start")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="goodput: TTFT target in seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="goodput: TPOT target in seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "serving-latency.png"))
    args = ap.parse_args(argv)
    proc = None
    target = args.target
    if target is None:
        proc, target = start_server(args)
    try:
        from jaxserve.serving.client import Client

        c = Client(target)
        c.wait_until_serving()
        info = c.model_info()
        reqs = sharegpt_like(args.requests, info.vocab_size, args.seed, info.context_length)
        c.complete(reqs[0][0], max_tokens=4)  # first request after warm-up
        rows = []
        for i, rate in enumerate(args.rates):
            r = run_rate(target, reqs, rate, args.seed + i)
            good = [x for x in r["_per_request"] if x["ttft"] <= args.ttft_slo and x["tpot"] <= args.tpot_slo]
            r["goodput_req_s"] = len(good) / r["wall_s"]
            r.pop("_per_request")
            rows.append(r)
            print(
                f"rate {rate:>5.1f}/s: {r['req_s']:.2f} req/s, {r['output_tok_s']:.0f} tok/s, "
                f"TTFT p50/p90/p99 {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p90'] * 1e3:.0f}/{r['ttft_p99'] * 1e3:.0f} ms, "
                f"TPOT p50/p90/p99 {r['tpot_p50'] * 1e3:.1f}/{r['tpot_p90'] * 1e3:.1f}/{r['tpot_p99'] * 1e3:.1f} ms, "
                f"ITL p50/p90/p99 {r['itl_p50'] * 1e3:.1f}/{r['itl_p90'] * 1e3:.1f}/{r['itl_p99'] * 1e3:.1f} ms, "
                f"goodput {r['goodput_req_s']:.2f} req/s",
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    out = {
        "model": info.model_name,
        "requests_per_rate": args.requests,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        rates = [r["rate"] for r in rows]
        for q in (50, 90, 99):
            ax[0].plot(rates, [r[f"ttft_p{q}"] * 1e3 for r in rows], marker="o", label=f"TTFT p{q}")
            ax[1].plot(rates, [r[f"tpot_p{q}"] * 1e3 for r in rows], marker="o", label=f"TPOT p{q}")
        for a, t in zip(ax, ("time to first token (ms)", "time per output token (ms)")):
            a.set_xlabel("offered load (requests/s)")
            a.set_ylabel(t)
            a.grid(alpha=0.3)
            a.legend()
        fig.suptitle(f"jaxserve serving latency vs rate ({info.model_name}, CPU)")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
