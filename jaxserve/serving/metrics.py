"""Prometheus metrics of the server, in a registry of their own (tests start several servers).

Two families in one registry: jaxserve's own (`jaxserve_*`) and vLLM's names (`vllm:*`, with
vLLM's `model_name` label) for what routers and dashboards built for vLLM read: the llm-d /
Gateway API Inference Extension endpoint picker scrapes `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` and `vllm:cache_config_info` from the serving port's /metrics.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, model_name: str = "", page_size: int = 0, num_pages: int = 0):
        """model_name, page_size, num_pages: vLLM's `model_name` label and cache_config_info."""
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
        self.vllm = VllmMetrics(r, model_name, page_size, num_pages)
        self.engine_stats: dict = {}  # the last step's EngineCore.stats (routers' /get_load reads it)

    def update_engine(self, stats: dict) -> None:
        self.engine_stats = stats
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_pages_used.set(stats["kv_pages_used"])
        self.kv_pages_total.set(stats["kv_pages_total"])
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        self.preemptions.set(stats["preemptions"])
        if "spec_mean_accepted" in stats:
            self.spec_accepted.set(stats["spec_mean_accepted"])
        self.vllm.update_engine(stats)

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
        metrics.vllm.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """An output with n new tokens was sent."""
        if n:
            now = time.perf_counter()
            v = self.m.vllm
            if self.first_at is None:
                self.first_at = now
                self.m.ttft.observe(now - self.start)
                v.ttft.observe(now - self.start)
            else:
                self.m.itl.observe(now - self.last)
                v.itl.observe(now - self.last)
            self.last = now
            self.completion += n
            self.m.generation_tokens.inc(n)
            v.generation_tokens.inc(n)

    def finish(self, outcome: str) -> None:
        """outcome: a finish reason, or cancelled / invalid / rejected / error."""
        self.m.requests.labels(outcome).inc()
        v = self.m.vllm
        v.e2e.observe(time.perf_counter() - self.start)
        if outcome in ("stop", "length", "abort"):
            v.success.labels(v.model_name, outcome).inc()
        if self.first_at is not None and self.completion > 1:
            self.m.tpot.observe((self.last - self.first_at) / (self.completion - 1))
            v.tpot.observe((self.last - self.first_at) / (self.completion - 1))


class VllmMetrics:
    """vLLM's metric names and meanings (vllm/v1/metrics/loggers.py), for tools built for vLLM.
    kv_cache_usage_perc counts the pages requests hold (0..1): cached prefixes no request uses
    can be evicted at once, so, as in vLLM, they count as free. The prefix-cache counters are
    in tokens, as vLLM's."""

    def __init__(self, r: CollectorRegistry, model_name: str, page_size: int, num_pages: int):
        self.model_name = model_name
        m = ["model_name"]
        gauge = lambda name, doc: Gauge(name, doc, m, registry=r).labels(model_name)  # noqa: E731
        counter = lambda name, doc: Counter(name, doc, m, registry=r).labels(model_name)  # noqa: E731
        hist = lambda name, doc: Histogram(name, doc, m, buckets=_LATENCY, registry=r).labels(model_name)  # noqa: E731
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage")
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        )
        info.labels(str(page_size), str(num_pages)).set(1)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens"
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine")
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds")
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds")
        self.tpot = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds")
        self._seen = {"prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0, "preemptions": 0}

    def update_engine(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        total = stats["kv_pages_total"]
        self.kv_usage.set(stats["kv_pages_active"] / total if total else 0.0)
        for key, c in (
            ("prefix_cache_queried_tokens", self.prefix_queries),
            ("prefix_cache_hit_tokens", self.prefix_hits),
            ("preemptions", self.preemptions),
        ):  # the engine's totals, as counter increments
            if stats[key] > self._seen[key]:
                c.inc(stats[key] - self._seen[key])
            self._seen[key] = stats[key]
