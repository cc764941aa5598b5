"""lm-evaluation-harness against `jaxserve serve --http-port`, compared with lm-eval's own `hf`
backend on the same checkpoint: the same accuracy on a 20-item multiple-choice task and a
perplexity within 1% on 10 short texts (tests/data/lm_eval/, offline), plus a generate task
through `local-chat-completions` that must run to the end.

lm-eval (with datasets, evaluate, ...) is heavy for the test extra, so it lives in a venv of
its own that sees this venv's torch and transformers through a .pth file (~30 s to create):

    python scripts/lm_eval_check.py                 # creates /tmp/lmeval-venv on first use
    python scripts/lm_eval_check.py --venv DIR --model assets/models/default/target

Exits non-zero when a check fails. Run from the repository root.
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

LM_EVAL = "lm_eval[api,hf]==0.4.13"
ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"jaxserve exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("jaxserve did not become healthy")


def lm_eval(exe: Path, model: str, model_args: str, tasks: str, out: Path, *extra: str) -> dict:
    cmd = [str(exe), "--model", model, "--model_args", model_args, "--tasks", tasks]
    cmd += ["--include_path", str(TASKS), "--output_path", str(out), "--batch_size", "1", *extra]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(
        cmd, check=True, cwd=ROOT, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    )
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())["results"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path("/tmp/lmeval-venv"))
    ap.add_argument("--model", type=Path, default=ROOT / "assets" / "models" / "default" / "target")
    ap.add_argument("--max-length", type=int, default=256, help="context of both backends (rolling windows)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/lm_eval_check"))
    args = ap.parse_args()
    exe = ensure_venv(args.venv)
    model = args.model.resolve()
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxserve.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--http-port",
            str(port),
            "--max-model-len",
            str(args.max_length),
            "--max-slots",
            "8",
        ],
        cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base + "/health", server)
        served = model.name
        common = f"model={served},tokenizer_backend=huggingface,tokenizer={model},max_length={args.max_length}"
        ours = lm_eval(
            exe,
            "local-completions",
            f"base_url={base}/v1/completions,{common},num_concurrent=4,max_retries=1",
            "jaxserve_mc,jaxserve_ppl",
            args.out / "jaxserve",
        )
        remote = lm_eval(  # tokenized by the server's /tokenize, /detokenize and /tokenizer_info
            exe,
            "local-completions",
            f"base_url={base}/v1/completions,model={served},tokenizer_backend=remote,max_length={args.max_length},"
            "max_retries=1",
            "jaxserve_mc",
            args.out / "remote",
        )
        chat = lm_eval(
            exe,
            "local-chat-completions",
            f"base_url={base}/v1/chat/completions,model={served},max_retries=1",
            "jaxserve_gen",
            args.out / "chat",
            "--apply_chat_template",
        )
    finally:
        server.terminate()
        server.wait(60)
    ref = lm_eval(
        exe,
        "hf",
        # local-completions encodes without special tokens (its add_bos_token=False default); the hf
        # backend's tokenizer default would add a BOS to every piece it encodes: the same inputs need
        # add_bos_token=False here (both then start rolling windows with the BOS prefix token)
        f"pretrained={model},dtype=float32,max_length={args.max_length},add_bos_token=False",
        "jaxserve_mc,jaxserve_ppl",
        args.out / "hf",
        "--device",
        "cpu",
    )
    ok = True
    print(f"{'metric':34} {'jaxserve':>12} {'hf':>12}")
    for task, metric, tol in [
        ("jaxserve_mc", "acc,none", 0.0),
        ("jaxserve_mc", "acc_norm,none", 0.0),
        ("jaxserve_ppl", "word_perplexity,none", 0.01),
        ("jaxserve_ppl", "byte_perplexity,none", 0.01),
        ("jaxserve_ppl", "bits_per_byte,none", 0.01),
    ]:
        a, b = ours[task][metric], ref[task][metric]
        good = abs(a - b) <= tol * abs(b) + 1e-9
        ok &= good
        print(f"{task + ' ' + metric:34} {a:12.6f} {b:12.6f} {'ok' if good else 'MISMATCH'}")
    for metric in ("acc,none", "acc_norm,none"):
        a, b = remote["jaxserve_mc"][metric], ref["jaxserve_mc"][metric]
        ok &= a == b
        print(f"{'jaxserve_mc ' + metric + ' (remote tok.)':34} {a:12.6f} {b:12.6f} {'ok' if a == b else 'MISMATCH'}")
    n_gen = chat["jaxserve_gen"]
    print(f"jaxserve_gen (local-chat-completions) exact_match: {n_gen.get('exact_match,none')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
