"""The A/B runner: rounds alternate between configurations, so a slow spell of a shared host
falls on all of them, and each configuration is judged by its median round.

Round k runs every configuration on the same requests (workload.round(k)): in order A, B, C
when k is even, C, B, A when k is odd. Each configuration's result holds its rounds, the median
of each headline figure over its rounds (stats.headline), and, for the second configuration
on, the ratio of each median to the first configuration's.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Callable

from jaxserve.tools.bench.stats import RoundStats, headline


@dataclasses.dataclass
class Config:
    """One side of a comparison: a label and what it is (LLM options, or a server's base URL)."""

    label: str
    spec: dict


def round_line(label: str, k: int, s: dict) -> str:
    ms = lambda m, q: 1e3 * s[m][q]  # noqa: E731
    return (
        f"[{label}] round {k}: {s['completed']}/{s['num_requests']} ok in {s['wall_s']:.2f}s, "
        f"{s['output_tok_s']:.1f} out tok/s, {s['total_tok_s']:.1f} total tok/s | "
        f"TTFT p50/p99 {ms('ttft_s', 'p50'):.1f}/{ms('ttft_s', 'p99'):.1f} ms, "
        f"ITL p50/p99/max {ms('itl_s', 'p50'):.1f}/{ms('itl_s', 'p99'):.1f}/{ms('itl_s', 'max'):.1f} ms, "
        f"TPOT p50 {ms('tpot_s', 'p50'):.2f} ms, E2E p50 {ms('e2e_s', 'p50'):.0f} ms"
    )


def order(k: int, n: int) -> list[int]:
    """Round k's order of n configurations: 0, 1, ... when k is even, reversed when it is odd."""
    return list(range(n)) if k % 2 == 0 else list(range(n))[::-1]


def run_ab(
    configs: list[Config],
    run_round: Callable[[int, int], RoundStats],
    rounds: int,
    *,
    with_requests: bool = True,
    out=None,
) -> list[dict]:
    """run_round(config index, round index) -> RoundStats, called in the alternating order.
    Returns one result dict per configuration (the `configs` list of the result JSON)."""
    per: list[list[RoundStats]] = [[] for _ in configs]
    for k in range(rounds):
        for c in order(k, len(configs)):
            r = run_round(c, k)
            per[c].append(r)
            print(round_line(configs[c].label, k, r.summary()), file=out or sys.stdout, flush=True)
    results = []
    for cfg, rs in zip(configs, per):
        heads = [headline(r.summary()) for r in rs]
        median = {m: statistics.median(h[m] for h in heads) for m in heads[0]}
        results.append(
            {
                "label": cfg.label,
                "spec": cfg.spec,
                "rounds": [r.to_json(with_requests) for r in rs],
                "median": median,
            }
        )
    first = results[0]["median"]
    for r in results[1:]:
        r["ratio_vs_first"] = {m: (v / first[m] if first[m] else float("nan")) for m, v in r["median"].items()}
    return results


def print_medians(results: list[dict], out=None) -> None:
    """The per-configuration medians, and the ratios against the first configuration."""
    for r in results:
        m = r["median"]
        line = (
            f"{r['label']}: median of {len(r['rounds'])} rounds: {m['output_tok_s']:.1f} out tok/s, "
            f"{m['total_tok_s']:.1f} total tok/s, TTFT p50 {1e3 * m['ttft_p50_s']:.1f} ms, "
            f"ITL p50/p99 {1e3 * m['itl_p50_s']:.1f}/{1e3 * m['itl_p99_s']:.1f} ms, "
            f"TPOT p50 {1e3 * m['tpot_p50_s']:.2f} ms"
        )
        if "ratio_vs_first" in r:
            q = r["ratio_vs_first"]
            line += (
                f" | vs {results[0]['label']}: throughput {q['output_tok_s']:.3f}x, TTFT p50 {q['ttft_p50_s']:.3f}x, "
                f"ITL p99 {q['itl_p99_s']:.3f}x"
            )
        print(line, file=out or sys.stdout, flush=True)
