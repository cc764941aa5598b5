"""Online serving: Poisson arrivals at several request rates against a running jaxserve, over
gRPC and over the OpenAI-compatible HTTP API, side by side.

A seeded ShareGPT-like mix of lengths (log-normal prompt and output lengths, clipped) is sent
at each rate over each protocol (gRPC streaming Generate; HTTP POST /v1/completions with
`stream: true`, server-sent events); per request we record TTFT, TPOT and the gaps between
streamed messages (inter-token latency). Both protocols get the same lengths at the same rate
from the same server; each run draws fresh prompt tokens (so no run hits the prefix cache of
another) and the order of the protocols alternates from rate to rate. Reports p50/p90/p99,
request and token throughput and goodput (requests per second that met the latency targets),
then HTTP against gRPC: throughput ratio and TTFT p50 difference. Rate `inf` sends every
request at once (the server's capacity). Starts its own server (both protocols) on the default
model unless --target / --http-target is given.

    .venv/bin/python scripts/bench_serving.py [--rates 2 8 inf] [--requests 40] [--protocols grpc http]
        [--repeats 2] [--target HOST:PORT] [--http-target http://HOST:PORT]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
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


def fresh_tokens(reqs, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """The same lengths with new random tokens: a run never reuses another run's prefix cache."""
    rng = np.random.default_rng(seed)
    return [([int(x) for x in rng.integers(3, vocab, len(p))], o) for p, o in reqs]


def grpc_stream(target: str, prompt: list[int], out_len: int) -> tuple[list[float], int]:
    """One streamed request over gRPC: arrival times of the messages with tokens, tokens."""
    from jaxserve.serving.client import Client

    c = Client(target)
    times, n = [], 0
    try:
        for r in c.generate(prompt, max_tokens=out_len, temperature=0, ignore_eos=True):
            if r.token_ids:
                times.append(time.perf_counter())
                n += len(r.token_ids)
    finally:
        c.close()
    return times, n


def http_stream(base: str, model: str, prompt: list[int], out_len: int) -> tuple[list[float], int]:
    """One streamed request over HTTP (POST /v1/completions, server-sent events): arrival times
    of the chunks (one per engine output, as over gRPC), and the tokens from `usage`."""
    host, port = base.split("//", 1)[-1].rstrip("/").rsplit(":", 1)
    body = dict(
        model=model,
        prompt=prompt,
        max_tokens=out_len,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    conn = http.client.HTTPConnection(host, int(port))
    times, n = [], 0
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            if b'"usage":{' in data.replace(b" ", b""):  # the last chunk: no choices, the usage
                n = json.loads(data)["usage"]["completion_tokens"]
            else:
                times.append(time.perf_counter())
    finally:
        conn.close()
    return times, n


def run_rate(sends: list, reqs: list[list], rate: float, seed: int) -> list[dict]:
    """Poisson arrivals at `rate` (inf: all at once); at each arrival, request i of reqs[k] goes
    out through sends[k](prompt, out_len) -> (token arrival times, tokens), for every k at the
    same instant (one sender: a plain run; two: a paired run). Returns, per sender, the wall time
    and each request's TTFT, TPOT, tokens and inter-token gaps (in arrival order)."""
    rng = np.random.default_rng(seed)
    n = len(reqs[0])
    gaps = rng.exponential(1.0 / rate, n) if math.isfinite(rate) else np.zeros(n)
    results: list[list[dict | None]] = [[None] * n for _ in sends]
    ends = [0.0] * len(sends)

    def one(k: int, i: int, prompt: list[int], out_len: int) -> None:
        t0 = time.perf_counter()
        times, n_out = sends[k](prompt, out_len)
        end = time.perf_counter()
        ends[k] = max(ends[k], end)
        results[k][i] = {
            "ttft": times[0] - t0,
            "e2e": end - t0,
            "tokens": n_out,
            "tpot": (times[-1] - times[0]) / max(n_out - 1, 1),
            "itl": list(np.diff(times)),
        }

    threads = []
    start = time.perf_counter()
    for i, gap in enumerate(gaps):
        time.sleep(gap)
        for k in range(len(sends)):
            t = threading.Thread(target=one, args=(k, i, *reqs[k][i]))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    return [{"wall_s": ends[k] - start, "_per_request": results[k]} for k in range(len(sends))]


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    """A server with both frontends: (process, gRPC HOST:PORT, HTTP base URL)."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--http-port", "0"]
    cmd += ["--max-slots", str(args.max_slots)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    target = None
    for line in proc.stdout:
        m = re.search(r"serving on ([\d.]+:\d+)", line)
        if m:
            target = m.group(1)
        m = re.search(r"OpenAI-compatible HTTP on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, target, m.group(1)
    raise RuntimeError("server did not start")


def _pct_row(name: str, r: dict) -> str:
    return (
        f"{name:>5} rate {r['rate']:>5}/s: {r['req_s']:.2f} req/s, {r['output_tok_s']:.0f} tok/s, "
        f"TTFT p50/p90/p99 {r['ttft_p50'] * 1e3:.1f}/{r['ttft_p90'] * 1e3:.1f}/{r['ttft_p99'] * 1e3:.1f} ms, "
        f"TPOT p50/p90/p99 {r['tpot_p50'] * 1e3:.1f}/{r['tpot_p90'] * 1e3:.1f}/{r['tpot_p99'] * 1e3:.1f} ms, "
        f"ITL p50/p90/p99 {r['itl_p50'] * 1e3:.1f}/{r['itl_p90'] * 1e3:.1f}/{r['itl_p99'] * 1e3:.1f} ms, "
        f"goodput {r['goodput_req_s']:.2f} req/s"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="gRPC HOST:PORT of a running server")
    ap.add_argument("--http-target", default=None, help="HTTP base URL of a running server (--http-port)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 8, math.inf], help="requests/s; inf: all at once")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--protocols", nargs="+", choices=("grpc", "http"), default=["grpc", "http"])
    ap.add_argument("--repeats", type=int, default=1, help="runs per rate and protocol (pooled)")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="send each arrival over every protocol at once (the same lengths, at the same moment): "
        "the per-request cost of a path, free of the drift of a shared machine between runs",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="goodput: TTFT target in seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="goodput: TPOT target in seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "serving-latency.png"))
    args = ap.parse_args(argv)
    proc = None
    target, http_target = args.target, args.http_target
    if target is None and http_target is None:
        proc, target, http_target = start_server(args)
    missing = [p for p, t in (("grpc", target), ("http", http_target)) if p in args.protocols and t is None]
    if missing:
        ap.error(f"--protocols {' '.join(missing)} needs its target")
    try:
        info = _model_info(target, http_target)
        lengths = sharegpt_like(args.requests, info["vocab_size"], args.seed, info["context_length"])
        senders = {
            "grpc": lambda prompt, n: grpc_stream(target, prompt, n),
            "http": lambda prompt, n: http_stream(http_target, info["model_name"], prompt, n),
        }
        for proto in args.protocols:  # unmeasured: every path, then every shape of the burst, runs once
            senders[proto](lengths[0][0][:8], 4)
        warm = fresh_tokens(lengths, info["vocab_size"], args.seed + 999_999)
        run_rate([senders[args.protocols[0]]], [warm], math.inf, 0)
        pooled: dict[tuple[float, str], list[dict]] = {}
        for k in range(args.repeats):
            for i, rate in enumerate(args.rates):
                seed = lambda proto: args.seed + 1000 * k + 10 * i + len(proto)  # noqa: E731
                if args.paired:  # every arrival goes out over each protocol at once
                    reqs = [fresh_tokens(lengths, info["vocab_size"], seed(p)) for p in args.protocols]
                    runs = run_rate([senders[p] for p in args.protocols], reqs, rate, args.seed + i)
                    for proto, r in zip(args.protocols, runs):
                        pooled.setdefault((rate, proto), []).append(r)
                    continue
                order = args.protocols if (i + k) % 2 == 0 else args.protocols[::-1]
                for proto in order:
                    reqs = fresh_tokens(lengths, info["vocab_size"], seed(proto))
                    (r,) = run_rate([senders[proto]], [reqs], rate, args.seed + i)
                    pooled.setdefault((rate, proto), []).append(r)
        rows = []
        for rate in args.rates:
            for proto in args.protocols:
                r = _pool(pooled[(rate, proto)], rate, args)
                r["protocol"] = proto
                rows.append(r)
                print(_pct_row(proto, r), flush=True)
            if set(args.protocols) == {"grpc", "http"}:
                g, h = (next(r for r in rows if r["rate"] == rate and r["protocol"] == p) for p in ("grpc", "http"))
                line = (
                    f"  http vs grpc at {rate}/s: throughput {h['output_tok_s'] / g['output_tok_s']:.3f}x, "
                    f"TTFT p50 {1e3 * (h['ttft_p50'] - g['ttft_p50']):+.1f} ms, "
                    f"TPOT p50 {1e3 * (h['tpot_p50'] - g['tpot_p50']):+.2f} ms"
                )
                if args.paired:  # the median over arrivals of (HTTP - gRPC), each pair sent at once
                    pairs = [
                        (a, b)
                        for rg, rh in zip(pooled[(rate, "grpc")], pooled[(rate, "http")])
                        for a, b in zip(rg["_per_request"], rh["_per_request"])
                        if a and b
                    ]
                    for name in ("ttft", "e2e"):
                        h[f"paired_{name}_diff_p50"] = float(np.median([b[name] - a[name] for a, b in pairs]))
                    line += (
                        f"; paired: TTFT {1e3 * h['paired_ttft_diff_p50']:+.1f} ms, "
                        f"end-to-end {1e3 * h['paired_e2e_diff_p50']:+.1f} ms (median of {len(pairs)} pairs)"
                    )
                print(line, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    out = {
        "model": info["model_name"],
        "requests_per_rate": args.requests,
        "repeats": args.repeats,
        "paired": args.paired,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        _plot(rows, args, info["model_name"])
    return 0


def _model_info(target: str | None, http_target: str | None) -> dict:
    if target is not None:
        from jaxserve.serving.client import Client

        c = Client(target)
        c.wait_until_serving()
        m = c.model_info()
        return {"model_name": m.model_name, "vocab_size": m.vocab_size, "context_length": m.context_length}
    import urllib.request

    with urllib.request.urlopen(http_target.rstrip("/") + "/v1/models") as r:
        card = json.load(r)["data"][0]
    # The HTTP API does not report the vocabulary: token ids below 256 are in every vocabulary.
    return {"model_name": card["id"], "vocab_size": 256, "context_length": card["max_model_len"]}


def _pool(runs: list[dict], rate: float, args) -> dict:
    """One row from several runs at one rate and protocol: percentiles over all their requests,
    throughput over their summed wall time."""
    per_request = [x for r in runs for x in r["_per_request"] if x]
    wall = sum(r["wall_s"] for r in runs)
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
    good = [x for x in per_request if x["ttft"] <= args.ttft_slo and x["tpot"] <= args.tpot_slo]
    itl = [g for x in per_request for g in x["itl"]]
    row = {
        "rate": rate,
        "runs": len(runs),
        "wall_s": wall,
        "completed": len(per_request),
        "req_s": len(per_request) / wall,
        "output_tok_s": sum(x["tokens"] for x in per_request) / wall,
        "goodput_req_s": len(good) / wall,
    }
    for name, xs in (("ttft", [x["ttft"] for x in per_request]), ("tpot", [x["tpot"] for x in per_request])):
        row.update({f"{name}_p{q}": pct(xs, q) for q in (50, 90, 99)})
    row.update({f"itl_p{q}": pct(itl, q) for q in (50, 90, 99)})
    return row


def _plot(rows: list[dict], args, model_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    finite = [r for r in rows if math.isfinite(r["rate"])]
    for proto, color in zip(args.protocols, ("tab:blue", "tab:orange")):
        mine = [r for r in finite if r["protocol"] == proto]
        rates = [r["rate"] for r in mine]
        for q, style in ((50, "-"), (90, "--")):
            for a, name in zip(ax, ("ttft", "tpot")):
                ys = [r[f"{name}_p{q}"] * 1e3 for r in mine]
                a.plot(rates, ys, style, color=color, marker="o", label=f"{proto} {name.upper()} p{q}")
    for a, t in zip(ax, ("time to first token (ms)", "time per output token (ms)")):
        a.set_xlabel("offered load (requests/s)")
        a.set_ylabel(t)
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"jaxserve serving latency vs rate ({model_name}, CPU): {' and '.join(args.protocols)}")
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
