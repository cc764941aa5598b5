"""The one JSON result schema of `jaxserve bench` (written with --out FILE.json; docs/benchmarks.md
describes it for readers)::

    {
      "schema": "jaxserve.bench/1",
      "bench": "throughput" | "latency" | "serve" | "prefix" | "speculative" | "kernels" | "structured" | ...,
      "created": "2026-12-02T09:00:00Z",
      "argv": [...],                       # the command line after `jaxserve bench`
      "host": {"python", "machine", "cpu", "cores", "jax", "backend", "device"},
      "workload": {...},                   # Workload.describe(): kind, lengths, seed, totals
      "configs": [                         # one per --engine-opts / --base-url / compared setting
        {"label": "A", "spec": {...},
         "rounds": [{"wall_s", "num_requests", "completed", "failed", "prompt_tokens",
                     "output_tokens", "req_s", "output_tok_s", "total_tok_s",
                     "ttft_s" | "itl_s" | "tpot_s" | "e2e_s": {"count", "mean", "p50", "p90", "p99", "max"},
                     "extra": {...},
                     "requests": [{"prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s",
                                   "itl_s": [...], "error"}]}],
         "median": {"output_tok_s", "total_tok_s", "req_s", "wall_s",
                    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_max_s", "itl_...", "tpot_...", "e2e_..."},
         "ratio_vs_first": {same keys}}],  # from the second configuration on: its median / the first's
      "measurements": [                    # kernels: one row per timed call
        {"name", "config", "ms", "bytes", "bound_ms", "fraction_of_bound", "gbps", "stream_gbps", ...}],
      "summary": {...}                     # the bench's own headline (e.g. prefix: TTFT speedup)
    }

Times are seconds unless a name ends in _ms; rates are per second of wall time.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

SCHEMA = "jaxserve.bench/1"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info() -> dict:
    """Where it ran. jax is described only if this process already imported it (serve does not)."""
    d = {"python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_name(), "cores": os.cpu_count()}
    jax = sys.modules.get("jax")
    if jax is not None:
        d.update(jax=jax.__version__, backend=jax.default_backend(), device=jax.devices()[0].device_kind)
    return d


def document(bench: str, argv: list[str], **fields) -> dict:
    doc = {
        "schema": SCHEMA,
        "bench": bench,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": list(argv),
        "host": host_info(),
        "workload": None,
        "configs": [],
        "measurements": [],
        "summary": {},
    }
    doc.update(fields)
    return doc


def _finite(x):
    """NaN and infinities as null: the file stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write(doc: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(_finite(doc), indent=1, allow_nan=False))
        print(f"results written to {path}", flush=True)
