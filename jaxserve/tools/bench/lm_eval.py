"""`jaxserve bench lm-eval`: lm-evaluation-harness against `jaxserve serve --http-port`, beside
lm-eval's own `hf` backend on the same checkpoint.

The tasks are tests/data/lm_eval/ (offline, run from the repository root: their data_files are
relative): jaxserve_mc (20 multiple-choice items: loglikelihood) must get the same accuracy as
hf, jaxserve_ppl (10 short texts: rolling loglikelihood) perplexities within 1%, jaxserve_mc
again with the server's own tokenizer endpoints (tokenizer_backend=remote), and jaxserve_gen
through `local-chat-completions` must run to the end. A mismatch is an error exit.

lm-eval (with datasets, evaluate, ...) is heavy for the test extra, so it lives in a venv of its
own (--venv, created with pip on first use, ~30 s) that sees this interpreter's torch and
transformers through a .pth file.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jaxserve.tools.bench import flags, result

LM_EVAL = "lm_eval[api,hf]==0.4.13"
CHECKS = [  # (task, metric, relative tolerance) against the hf backend
    ("jaxserve_mc", "acc,none", 0.0),
    ("jaxserve_mc", "acc_norm,none", 0.0),
    ("jaxserve_ppl", "word_perplexity,none", 0.01),
    ("jaxserve_ppl", "byte_perplexity,none", 0.01),
    ("jaxserve_ppl", "bits_per_byte,none", 0.01),
]


def ensure_venv(venv: Path) -> Path:
    """A venv with lm-eval that imports this interpreter's packages (torch, transformers) too."""
    exe = venv / "bin" / "lm_eval"
    if exe.exists():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    inner = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(inner, "outer-venv.pth").write_text(site.getsitepackages()[0] + "\n")
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LM_EVAL], check=True)
    return exe


def _lm_eval(exe: Path, tasks_dir: Path, model: str, model_args: str, tasks: str, out: Path, *extra: str) -> dict:
    cmd = [str(exe), "--model", model, "--model_args", model_args, "--tasks", tasks, "--include_path", str(tasks_dir)]
    cmd += ["--output_path", str(out), "--batch_size", "1", *extra]
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env)
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())["results"]


def _serve(model: Path, max_length: int) -> tuple[subprocess.Popen, str]:
    """`jaxserve serve` on a free port, once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model), "--port", "0"]
    cmd += ["--http-port", str(port), "--max-model-len", str(max_length), "--max-slots", "8"]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ValueError(f"serve: jaxserve exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return proc, base
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise ValueError("serve: jaxserve did not become healthy in 900 s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxserve bench lm-eval`'s flags."""
    p.add_argument("--model", default="assets/models/default/target", help="a checkpoint directory both load")
    p.add_argument("--venv", default="/tmp/lmeval-venv", help="lm-eval's venv (created on first use)")
    p.add_argument("--tasks", default="tests/data/lm_eval", help="the tasks' directory (run from the repository root)")
    p.add_argument("--max-length", type=flags.positive, default=256, help="context of both backends (rolling windows)")
    p.add_argument("--work", default="/tmp/lm_eval_check", help="lm-eval's output directory")
    flags.out_flag(p)


def run(args, argv) -> dict:
    tasks = Path(args.tasks).resolve()
    if not (tasks / "jaxserve_mc.yaml").is_file():
        raise FileNotFoundError(f"tasks: no jaxserve_mc.yaml in {tasks} (run from the repository root)")
    exe, model, out = ensure_venv(Path(args.venv)), Path(args.model).resolve(), Path(args.work)
    common = f"tokenizer_backend=huggingface,tokenizer={model},max_length={args.max_length}"
    proc, base = _serve(model, args.max_length)
    try:
        completions = f"base_url={base}/v1/completions,model={model.name},max_retries=1"
        ours = _lm_eval(exe, tasks, "local-completions", f"{completions},{common},num_concurrent=4",
                        "jaxserve_mc,jaxserve_ppl", out / "jaxserve")  # fmt: skip
        remote = _lm_eval(exe, tasks, "local-completions", f"{completions},tokenizer_backend=remote,"
                          f"max_length={args.max_length}", "jaxserve_mc", out / "remote")  # fmt: skip
        chat = f"base_url={base}/v1/chat/completions,model={model.name},max_retries=1"
        gen = _lm_eval(
            exe, tasks, "local-chat-completions", chat, "jaxserve_gen", out / "chat", "--apply_chat_template"
        )
    finally:
        proc.terminate()
        proc.wait(60)
    # local-completions encodes without special tokens (add_bos_token=False): hf must too
    hf_args = f"pretrained={model},dtype=float32,max_length={args.max_length},add_bos_token=False"
    ref = _lm_eval(exe, tasks, "hf", hf_args, "jaxserve_mc,jaxserve_ppl", out / "hf", "--device", "cpu")
    rows = [(f"{t} {m}", ours[t][m], ref[t][m], tol) for t, m, tol in CHECKS]
    rows += [(f"jaxserve_mc {m} (remote tokenizer)", remote["jaxserve_mc"][m], ref["jaxserve_mc"][m], 0.0)
             for m in ("acc,none", "acc_norm,none")]  # fmt: skip
    summary = {"generate_exact_match": gen["jaxserve_gen"].get("exact_match,none"), "checks": {}}
    for name, a, b, tol in rows:
        ok = abs(a - b) <= tol * abs(b) + 1e-9
        summary["checks"][name] = {"jaxserve": a, "hf": b, "ok": ok}
        print(f"{name:40} {a:12.6f} {b:12.6f} {'ok' if ok else 'MISMATCH'}", flush=True)
    print(f"jaxserve_gen (local-chat-completions) exact_match: {summary['generate_exact_match']}", flush=True)
    bad = [n for n, c in summary["checks"].items() if not c["ok"]]
    if bad:
        raise ValueError(f"lm-eval: jaxserve and hf differ on {', '.join(bad)}")
    return result.document("lm-eval", argv, workload={"tasks": str(tasks), "model": str(model)}, summary=summary)
