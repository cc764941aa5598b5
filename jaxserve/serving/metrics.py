"""Prometheus metrics of the server, in a registry of their own (tests start several servers)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxserve_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram(
            "jaxserve_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "jaxserve_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "jaxserve_inter_token_latency_seconds", "Gap between streamed messages", buckets=_LATENCY, registry=r
        )
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("jaxserve_requests_running", "Requests in decode slots", registry=r)
        self.waiting = Gauge("jaxserve_requests_waiting", "Requests waiting for a slot", registry=r)
        self.kv_pages_used = Gauge("jaxserve_kv_pages_used", "KV pages in use (requests and prefix cache)", registry=r)
        self.kv_pages_total = Gauge("jaxserve_kv_pages_total", "KV pages in the pool", registry=r)
        self.prefix_hit_rate = Gauge(
            "jaxserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", registry=r
        )
        self.spec_accepted = Gauge(
            "jaxserve_spec_decode_mean_accepted_tokens",
            "Mean tokens accepted per target step (speculative decoding)",
            registry=r,
        )
        self.preemptions = Gauge("jaxserve_preemptions", "Requests preempted so far", registry=r)

    def update_engine(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_pages_used.set(stats["kv_pages_used"])
        self.kv_pages_total.set(stats["kv_pages_total"])
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        self.preemptions.set(stats["preemptions"])
        if "spec_mean_accepted" in stats:
            self.spec_accepted.set(stats["spec_mean_accepted"])

    def serve(self, port: int, host: str = "127.0.0.1"):
        return start_http_server(port, addr=host, registry=self.registry)

    def request(self, prompt_tokens: int) -> "RequestMetrics":
        """Start timing one request (both frontends record the same metrics the same way)."""
        return RequestMetrics(self, prompt_tokens)


class RequestMetrics:
    """One request's TTFT, inter-token gaps, TPOT, token counts and outcome."""

    def __init__(self, metrics: Metrics, prompt_tokens: int):
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first_at: float | None = None
        self.completion = 0
        metrics.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """An output with n new tokens was sent."""
        if n:
            now = time.perf_counter()
            if self.first_at is None:
                self.first_at = now
                self.m.ttft.observe(now - self.start)
            else:
                self.m.itl.observe(now - self.last)
            self.last = now
            self.completion += n
            self.m.generation_tokens.inc(n)

    def finish(self, outcome: str) -> None:
        """outcome: a finish reason, or cancelled / invalid / rejected / error."""
        self.m.requests.labels(outcome).inc()
        if self.first_at is not None and self.completion > 1:
            self.m.tpot.observe((self.last - self.first_at) / (self.completion - 1))
