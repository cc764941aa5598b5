#!/usr/bin/env python
"""Restart time with and without a warm persistent compilation cache.

Runs `python -m jaxserve.cli generate --max-tokens 1 PROMPT` as a fresh process, first with an
empty (temporary) compilation cache directory, then again with the cache the first run filled,
and reports the time from process start to the first generated token for each:

    .venv/bin/python scripts/bench_restart.py                  # the shipped default model
    .venv/bin/python scripts/bench_restart.py --model DIR --gin_file jaxserve/configs/default.gin
    .venv/bin/python scripts/bench_restart.py --serve    # `jaxserve serve`, first token over gRPC

The compilation cache directory holds JAX's persistent XLA cache and jaxserve's executable store
(`jaxserve/executable_cache.py`): a warm restart loads every compiled step without tracing it.
Weights are converted once beforehand (`jaxserve convert`, untimed, into a temporary converted-
weight cache), so both timed runs load the same converted weights and differ only in whether
XLA compiles the warm-up's executables or loads them. If the default model
(assets/models/default/target) does not exist, a random Llama (8 layers, hidden 256) with a
small byte-level BPE tokenizer is built in a temporary directory, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "assets" / "models" / "default" / "target"


def build_random_llama(path: Path, layers: int = 8, hidden: int = 256, seed: int = 0) -> None:
    """A random LlamaForCausalLM and a byte-level BPE tokenizer trained on this repo's Python."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.read_text(errors="ignore") for p in sorted((REPO / "jaxserve").rglob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=1024,
            special_tokens=["<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))


def startup_log(err: str) -> dict:
    """Warm-up seconds and executable-store counts from the start-up log (None where absent)."""
    m = re.search(r"warm-up compiled every bucket in ([\d.]+)s", err)
    store = re.search(r"(\d+) executables loaded from .*, (\d+) compiled and saved", err)
    return {
        "warmup_s": float(m.group(1)) if m else None,
        "loaded": int(store.group(1)) if store else None,
        "compiled": int(store.group(2)) if store else None,
    }


def time_first_token(cmd: list[str], env: dict, prompt: str) -> dict:
    """Seconds from spawning the process to the first generated token: `generate` prints the prompt,
    then streams the completion and ends it with a newline, so the first byte after the prompt is the
    first token (or, if that token has no text, the newline that ends a --max-tokens 1 stream)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = b""
    first = None
    while True:
        ch = proc.stdout.read(1)
        if not ch:
            break
        out += ch
        if first is None and len(out) > len(prompt.encode()):
            first = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait()
    total = time.perf_counter() - t0
    if code != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{err[-3000:]}")
    return {
        "first_token_s": first,
        "process_s": total,
        **startup_log(err),
        "output": out.decode(errors="replace").rstrip("\n"),
    }


def time_first_token_served(cmd: list[str], env: dict, prompt: str, target: str) -> dict:
    """Seconds from spawning `jaxserve serve` to the first token streamed to a gRPC client that
    polls health every 50 ms and sends its request as soon as the server says SERVING."""
    import grpc

    from jaxserve.serving.client import Client

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    client = None
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr.read().decode()[-3000:]}")
            # A fresh channel per poll: a channel that failed to connect backs off for seconds.
            client = Client(target)
            try:
                if client.health() == "SERVING":
                    break
            except grpc.RpcError:
                pass
            client.close()
            time.sleep(0.05)
        serving = time.perf_counter() - t0
        stream = client.generate(prompt, max_tokens=1, temperature=0)
        first = next(iter(stream))
        first_s = time.perf_counter() - t0
        text = first.text + "".join(r.text for r in stream)
    finally:
        if client is not None:
            client.close()
        proc.terminate()  # SIGTERM: drain and exit
        err = proc.stderr.read().decode(errors="replace")
        proc.wait(timeout=60)
    return {"first_token_s": first_s, "serving_s": serving, **startup_log(err), "output": prompt + text}


def cache_stats(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--gin_file", action="append", default=[], help="passed to jaxserve generate")
    ap.add_argument("--gin_param", action="append", default=[], help="passed to jaxserve generate")
    ap.add_argument("--prompt", default="def f():")
    ap.add_argument("--warm-runs", type=int, default=3, help="warm restarts (the median is reported)")
    ap.add_argument(
        "--serve",
        action="store_true",
        help="restart `jaxserve serve` and time the first token streamed to a gRPC client",
    )
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="jaxserve-restart-") as tmp:
        tmp = Path(tmp)
        note = None
        model = Path(args.model) if args.model else DEFAULT_MODEL
        if args.model is None and not (DEFAULT_MODEL / "config.json").is_file():
            model = tmp / "random-llama"
            build_random_llama(model)
            note = (
                f"{DEFAULT_MODEL} does not exist yet: measured a random Llama instead "
                "(8 layers, hidden 256, 8 heads / 4 KV heads, vocab 1024, byte-level BPE)"
            )
            print(f"note: {note}", flush=True)
        env = dict(
            os.environ,
            JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
            PYTHONUNBUFFERED="1",
            JAXSERVE_CACHE_DIR=str(tmp / "jaxserve-cache"),
            TOKENIZERS_PARALLELISM="false",
        )
        py = [sys.executable, "-m", "jaxserve.cli"]
        gin = [a for f in args.gin_file for a in ("--gin_file", f)] + [
            a for b in args.gin_param for a in ("--gin_param", b)
        ]
        subprocess.run(
            py + ["convert", "--model", str(model)] + gin,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        xla = tmp / "xla"
        if args.serve:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = (
                py
                + [
                    "serve",
                    "--model",
                    str(model),
                    "--compilation-cache-dir",
                    str(xla),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ]
                + gin
            )
            run = lambda: time_first_token_served(cmd, env, args.prompt, f"127.0.0.1:{port}")  # noqa: E731
        else:
            cmd = (
                py
                + ["generate", "--model", str(model), "--max-tokens", "1", "--compilation-cache-dir", str(xla)]
                + gin
                + [args.prompt]
            )
            run = lambda: time_first_token(cmd, env, args.prompt)  # noqa: E731
        print("command:", " ".join(cmd), flush=True)
        cold = run()
        entries, size = cache_stats(xla)
        print(
            f"cold (empty cache):  first token after {cold['first_token_s']:.2f}s "
            f"(warm-up {cold['warmup_s']:.2f}s, {cold['compiled']} steps compiled; "
            f"cache now {entries} files, {size / 2**20:.1f} MiB)",
            flush=True,
        )
        warm_runs = [run() for _ in range(max(1, args.warm_runs))]
        warm = sorted(warm_runs, key=lambda r: r["first_token_s"])[len(warm_runs) // 2]  # the median run
        print(
            f"warm (filled cache): first token after {warm['first_token_s']:.2f}s (warm-up {warm['warmup_s']:.2f}s, "
            f"{warm['loaded']} steps loaded, {warm['compiled']} compiled; median of {len(warm_runs)}: "
            + ", ".join(f"{r['first_token_s']:.2f}s" for r in warm_runs)
            + ")"
        )
        ratio = cold["first_token_s"] / warm["first_token_s"]
        wratio = cold["warmup_s"] / warm["warmup_s"] if cold["warmup_s"] and warm["warmup_s"] else None
        print(
            f"speed-up: {ratio:.1f}x to the first token"
            + (f", {wratio:.1f}x in warm-up" if wratio else "")
            + (" (target >= 3x)" if ratio < 3 else "")
        )
        if cold["output"] != warm["output"]:
            print(f"WARNING: outputs differ: {cold['output']!r} vs {warm['output']!r}")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "model": str(model),
                        "note": note,
                        "command": cmd,
                        "cold": cold,
                        "warm": warm_runs,
                        "speedup_first_token": ratio,
                        "speedup_warmup": wratio,
                        "cache_entries": entries,
                        "cache_bytes": size,
                    },
                    indent=2,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
