"""What is measured per request and how it is summed up, the same for every driver.

Per request (`RequestRecord`), from the arrival times of the chunks that carried tokens:

- TTFT: first chunk - the moment the request was sent (offline: submitted);
- ITL: the gaps between successive chunks (a chunk is one engine output: usually one token,
  several with speculative decoding); a stream's stalls show here;
- TPOT: (end - first chunk) / (output tokens - 1), vLLM's definition (0 for one token);
- end-to-end latency: end - sent.

Per round (`RoundStats`): each of those summarised over its requests (ITL over all gaps of
all requests) as count, mean, p50, p90, p99, max (numpy's linear percentiles), and the
throughput: output tokens / wall, (prompt + output) tokens / wall, requests / wall, where
wall runs from the first send to the last end.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

QUANTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestRecord:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    itl_s: list[float]
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


class RequestTimer:
    """The driver's clock for one request: `sent()`, then `chunk(n_tokens)` at each streamed
    output, then `done(prompt_tokens, output_tokens)` -> RequestRecord. Every driver (offline
    steps, HTTP streams) records through this, so the metrics mean the same everywhere."""

    def __init__(self):
        self.t_sent: float | None = None
        self.chunks: list[float] = []
        self.tokens = 0

    def sent(self, t: float | None = None) -> None:
        self.t_sent = time.perf_counter() if t is None else t

    def chunk(self, n_tokens: int, t: float | None = None) -> None:
        if n_tokens > 0:
            self.chunks.append(time.perf_counter() if t is None else t)
            self.tokens += n_tokens

    def done(self, prompt_tokens: int, output_tokens: int | None = None, t: float | None = None) -> RequestRecord:
        end = time.perf_counter() if t is None else t
        if not self.chunks:
            return RequestRecord(prompt_tokens, 0, end - self.t_sent, end - self.t_sent, [], "no tokens")
        return RequestRecord(
            prompt_tokens,
            self.tokens if output_tokens is None else output_tokens,
            self.chunks[0] - self.t_sent,
            end - self.t_sent,
            [float(x) for x in np.diff(self.chunks)],
        )

    def failed(self, error: str, prompt_tokens: int = 0) -> RequestRecord:
        end = time.perf_counter()
        return RequestRecord(prompt_tokens, self.tokens, float("nan"), end - (self.t_sent or end), [], error)


def summarize(xs) -> dict:
    """count, mean, p50, p90, p99, max of a list of seconds (NaN fields when empty)."""
    a = np.asarray(list(xs), dtype=np.float64)
    if a.size == 0:
        return {"count": 0, "mean": float("nan"), **{f"p{q}": float("nan") for q in QUANTILES}, "max": float("nan")}
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        **{f"p{q}": float(np.percentile(a, q)) for q in QUANTILES},
        "max": float(a.max()),
    }


@dataclasses.dataclass
class RoundStats:
    """One round of one configuration: its requests and their summary."""

    wall_s: float
    requests: list[RequestRecord]
    extra: dict = dataclasses.field(default_factory=dict)  # bench-specific: cache hit rate, acceptance, ...
    outputs: list | None = dataclasses.field(default=None, repr=False)  # offline: token ids, not written

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.error is None]
        prompt = sum(r.prompt_tokens for r in ok)
        output = sum(r.output_tokens for r in ok)
        return {
            "wall_s": self.wall_s,
            "num_requests": len(self.requests),
            "completed": len(ok),
            "failed": len(self.requests) - len(ok),
            "prompt_tokens": prompt,
            "output_tokens": output,
            "req_s": len(ok) / self.wall_s,
            "output_tok_s": output / self.wall_s,
            "total_tok_s": (prompt + output) / self.wall_s,
            "ttft_s": summarize(r.ttft_s for r in ok),
            "itl_s": summarize(g for r in ok for g in r.itl_s),
            "tpot_s": summarize(r.tpot_s for r in ok if r.output_tokens > 1),
            "e2e_s": summarize(r.e2e_s for r in ok),
        }

    def to_json(self, with_requests: bool = True) -> dict:
        d = {**self.summary(), "extra": self.extra}
        if with_requests:
            d["requests"] = [r.to_json() for r in self.requests]
        return d


def headline(summary: dict) -> dict[str, float]:
    """The scalars an A/B comparison takes medians and ratios of."""
    out = {k: summary[k] for k in ("wall_s", "req_s", "output_tok_s", "total_tok_s")}
    for m in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        for q in ("p50", "p90", "p99", "max"):
            out[f"{m[:-2]}_{q}_s"] = summary[m][q]
    return out
