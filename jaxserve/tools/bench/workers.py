"""Engines in processes of their own beside the LLMs of `jaxserve bench throughput`: vLLM's offline
engine (--vllm-python: vLLM lives in a venv of its own, its torch and ours differ) and jaxserve
from another checkout (--baseline-checkout: the commit before, in a git worktree).

Each is a long-lived worker process (worker.py), alive for the whole run like the LLMs of the
other configurations: the A/B runner alternates rounds between all of them, on the same
requests. A worker's `generate` hands back whole requests, so its rounds have throughput (wall,
tokens per second) and no TTFT or ITL (those are `bench serve`'s, against a server).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

from jaxserve.tools.bench.stats import RequestRecord, RoundStats
from jaxserve.tools.bench.workload import Request

WORKER = Path(__file__).with_name("worker.py")


class Worker:
    """One engine's process: `round(requests)` -> RoundStats; `close()` ends it. kind: "vllm" (python:
    vLLM's venv) or "jaxserve" (this python, with `checkout` ahead of the installed jaxserve)."""

    def __init__(self, python: str, kind: str, model: str, opts: dict, text: bool, checkout: str | None = None):
        if not Path(python).is_file():
            raise FileNotFoundError(f"vllm_python: {python} is not a file (the python of a venv with vLLM)")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the engine's own packages
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        if checkout is not None:
            env["PYTHONPATH"] = str(Path(checkout).resolve())
        argv = [python, str(WORKER), kind, model, json.dumps(opts), "text" if text else "ids"]
        self.kind = kind
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir()
        )
        self._read("JAXSERVE-READY")

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise ValueError(f"{self.kind}: the worker exited with {self.proc.wait()} (its log is above)")

    def round(self, requests: list[Request]) -> RoundStats:
        reqs = [[r.prompt, r.output_len, r.temperature, r.top_p] for r in requests]
        self.proc.stdin.write(json.dumps(reqs) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._read("JAXSERVE "))
        nan = math.nan
        records = [RequestRecord(p, o, nan, nan, []) for p, o in reply["requests"]]
        return RoundStats(reply["wall_s"], records, {"engine": self.kind})

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
