"""The serving driver: Poisson arrivals against any OpenAI-compatible server.

Only the OpenAI completions API shape is used, so the same run measures `jaxserve serve
--http-port` and `vllm serve` alike: GET /v1/models names the model (the first one listed),
then each request is one POST /v1/completions with `stream: true` and
`stream_options.include_usage`, greedy, `ignore_eos` (an extension both servers accept) and
max_tokens = the request's output length. Prompts are token-id lists (the API allows them),
or text with --prompt-format text. Each server-sent chunk that carries a choice is a token
arrival for TTFT and ITL (a chunk with no text that only closes the choice is not); the
token count is the server's `usage.completion_tokens`.

Arrivals: exponential gaps at `rate` requests/s (seeded per round, the same schedule for each
server of an A/B run); rate inf sends every request at once. Each request runs on its own
thread, so a slow response never delays the next arrival.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from jaxserve.tools.bench.stats import RequestRecord, RequestTimer, RoundStats
from jaxserve.tools.bench.workload import Request


@dataclasses.dataclass(frozen=True)
class Endpoint:
    base_url: str  # scheme://host:port, no trailing /v1
    model: str
    max_model_len: int | None
    api_key: str | None = None

    def headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        u = urllib.parse.urlsplit(self.base_url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        return cls(u.hostname, u.port, timeout=timeout)


def normalize_base_url(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"base_url: expected http://HOST:PORT, got {url!r}")
    path = u.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    if path:
        raise ValueError(f"base_url: expected http://HOST:PORT (optionally ending in /v1), got {url!r}")
    return f"{u.scheme}://{u.netloc}"


def discover(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> Endpoint:
    """The server's model name (and max_model_len if it says) from GET /v1/models."""
    base = normalize_base_url(base_url)
    req = urllib.request.Request(base + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            cards = json.load(r).get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(f"base_url: GET {base}/v1/models failed: {e}") from None
    if not cards:
        raise ValueError(f"base_url: {base}/v1/models lists no model")
    return Endpoint(base, cards[0]["id"], cards[0].get("max_model_len"), api_key)


def stream_completion(ep: Endpoint, request: Request, timer: RequestTimer, timeout: float = 600.0) -> RequestRecord:
    """One streamed completion, timed from the moment it is sent."""
    body = {
        "model": ep.model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = ep.connection(timeout)
    usage = None
    try:
        timer.sent()
        conn.request("POST", "/v1/completions", json.dumps(body), ep.headers())
        resp = conn.getresponse()
        if resp.status != 200:
            return timer.failed(f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                return timer.failed(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text") or choice.get("finish_reason") is None:
                    timer.chunk(1, now)
        end = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as e:
        return timer.failed(f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    if usage is None:
        return timer.failed("no usage chunk (the server ignored stream_options.include_usage)")
    return timer.done(usage["prompt_tokens"], usage["completion_tokens"], t=end)


def arrival_gaps(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds between successive arrivals: exponential (a Poisson process) at `rate`/s; inf: 0."""
    if not math.isfinite(rate):
        return np.zeros(n)
    return np.random.default_rng(seed).exponential(1.0 / rate, n)


def run_serving(ep: Endpoint, requests: list[Request], rate: float, seed: int) -> RoundStats:
    """One round: the requests at Poisson arrivals, each on its own thread."""
    records: list = [None] * len(requests)

    def one(i: int) -> None:
        records[i] = stream_completion(ep, requests[i], RequestTimer())

    threads = []
    start = time.perf_counter()
    due = start
    for i, gap in enumerate(arrival_gaps(len(requests), rate, seed)):
        due += gap
        time.sleep(max(0.0, due - time.perf_counter()))
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return RoundStats(wall, records, {"rate": rate if math.isfinite(rate) else "inf", "base_url": ep.base_url})


# The replicas' own counters (vLLM's names; jaxserve exports them too): what routing changed.
REPLICA_COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "requests": "vllm:request_success_total",
}


def scrape_counters(metrics_url: str, timeout: float = 10.0) -> dict[str, float]:
    """REPLICA_COUNTERS read from one replica's Prometheus text (GET .../metrics), summed over labels."""
    url = normalize_base_url(metrics_url) + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"replica_metrics: GET {url} failed: {e}") from None
    out = dict.fromkeys(REPLICA_COUNTERS, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0]
        for key, metric in REPLICA_COUNTERS.items():
            if name == metric:
                out[key] += float(value.split()[0])
    return out


def replica_deltas(before: list[dict], after: list[dict]) -> dict:
    """What one round did on each replica, and the prefix-cache hit rate over all of them:
    sum of hit tokens / sum of queried tokens, from the replicas' own counters."""
    per = [{k: a[k] - b[k] for k in REPLICA_COUNTERS} for b, a in zip(before, after)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    return {"hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits, "queried_tokens": queries,
            "requests_per_replica": [int(p["requests"]) for p in per]}  # fmt: skip


def warm_up(ep: Endpoint, prompt: list[int] | str) -> None:
    """One short unmeasured request: the first request of a fresh server pays one-time costs."""
    rec = stream_completion(ep, Request(prompt, 4), RequestTimer())
    if rec.error:
        raise ValueError(f"base_url: {ep.base_url} refused a warm-up completion: {rec.error}")
