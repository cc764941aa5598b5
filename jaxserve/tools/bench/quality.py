"""`jaxserve bench quality`: what an engine option costs in accuracy, through the serving path.

Each configuration (--engine-opts; the first is the reference, e.g. float32 against int8
weights, an int8 or fp8 KV cache, bfloat16 matmuls, or the Pallas attention against XLA's on a
GPU) is one `LLM`, loaded one after another, and gets:

- held-out loss: the mean next-token cross-entropy (nats) over --windows windows of
  --seq-len + 1 tokens, from the engine's own prompt logprobs (the prefill as it serves: attention
  reads every key and value as the page pool holds them, reference.write_kv, so an 8-bit KV
  cache's rounding is in every position). The text is --text files, or
  by default the held-out split of Python's standard library that scripts/train_default_model.py
  keeps out of training (files whose sha256(relative path) % 50 == 0): documents between BOS and
  EOS, cut into non-overlapping windows, --windows of them evenly spaced;
- greedy agreement with the reference: --num-prompts prompts (the first --prompt-len tokens of
  evenly spaced windows, or with --random-prompts seeded random ids: a random-weight model's
  case), --output-len greedy tokens each, EOS ignored: identical completions, the share of
  equal tokens, and the mean position of the first difference.
"""

from __future__ import annotations

import argparse
import hashlib
import sysconfig
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from jaxserve.tools.bench import flags, result

# directories of the standard library the corpus leaves out
EXCLUDE_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "pydoc_data",
                "ensurepip", "__pycache__"}  # fmt: skip


def stdlib_files(stdlib: Path | None = None) -> list[tuple[str, str]]:
    """(relative posix path, text) of the standard library's .py files, sorted by path: the
    corpus scripts/train_default_model.py trains and holds out from."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(stdlib.rglob("*.py"), key=lambda q: q.relative_to(stdlib).as_posix()):
        rel = p.relative_to(stdlib)
        if any(d in EXCLUDE_DIRS or d.startswith("config-") for d in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):  # machine-specific build settings
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            out.append((rel.as_posix(), text))
    return out


def is_heldout(rel: str, modulus: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % modulus == 0


def heldout_texts(modulus: int = 50) -> list[str]:
    """The standard library's held-out .py files (train_default_model.py's split), by path."""
    return [text for rel, text in stdlib_files() if is_heldout(rel, modulus)]


def windows(tokenizer, texts: list[str], seq_len: int, count: int) -> np.ndarray:
    """[count, seq_len + 1] token windows, evenly spaced over the documents' stream."""
    ids: list[int] = []
    for t in texts:
        body = tokenizer.encode(t, add_special_tokens=False)
        ids += [tokenizer.bos_token_id] * (tokenizer.bos_token_id is not None) + body
        ids += [tokenizer.eos_token_id] * (tokenizer.eos_token_id is not None)
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(f"text: {len(ids)} tokens, fewer than one window of --seq-len {seq_len} + 1")
    stream = np.asarray(ids, np.int64)
    picks = np.unique(np.linspace(0, n - 1, min(count, n)).astype(int))
    return stream[picks[:, None] * seq_len + np.arange(seq_len + 1)[None]]


def heldout_loss(llm, wins: np.ndarray) -> float:
    """Mean -log p(token | the tokens before it) over every window position after the first."""
    from jaxserve.llm import SamplingParams

    outs = llm.generate([w.tolist() for w in wins], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    nll = [-lp[tok] for w, o in zip(wins, outs) for tok, lp in zip(w[1:].tolist(), o.prompt_logprobs[1:])]
    return float(np.mean(nll))


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(outs, ref)]
    return {
        "identical_completions": f"{sum(a == b for a, b in zip(outs, ref))}/{len(ref)}",
        "token_agreement": sum(x == y for a, b in zip(outs, ref) for x, y in zip(a, b)) / sum(len(b) for b in ref),
        "mean_first_difference": float(np.mean(first_diff)),
    }


def _inputs(args, llm) -> tuple[np.ndarray | None, list[list[int]]]:
    """(held-out windows or None, greedy prompts), made once, with the first LLM's tokenizer."""
    wins, prompts = None, []
    if args.windows or (args.num_prompts and not args.random_prompts):
        texts = [Path(f).read_text() for f in args.text] if args.text else heldout_texts()
        count = max(args.windows, 0 if args.random_prompts else args.num_prompts)
        wins = windows(llm.tokenizer, texts, max(args.seq_len, args.prompt_len), count)
    if args.random_prompts:
        rng = np.random.default_rng(0)
        vocab = llm.model_cfg.vocab_size
        prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    elif args.num_prompts:
        prompts = [w[: args.prompt_len].tolist() for w in wins[: args.num_prompts]]
    return wins, prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxserve bench quality`'s flags."""
    flags.engine_flags(p)
    p.add_argument("--workload-file", metavar="FILE.json", help="a JSON workload whose `model` --model workload builds")
    p.add_argument("--text", action="append", default=[], metavar="FILE", help="held-out text (default: the stdlib's "
                   "held-out split of scripts/train_default_model.py); repeatable")  # fmt: skip
    p.add_argument("--windows", type=int, default=64, help="held-out windows scored (default 64; 0: no loss)")
    p.add_argument("--seq-len", type=flags.positive, default=256, help="predicted tokens per window (default 256)")
    p.add_argument("--num-prompts", type=int, default=64, help="greedy prompts (default 64; 0: no agreement)")
    p.add_argument("--random-prompts", action="store_true", help="greedy prompts of seeded random ids, not text")
    p.add_argument("--prompt-len", type=flags.positive, default=32)
    p.add_argument("--output-len", type=flags.positive, default=128)
    flags.out_flag(p)


def run(args, argv, build_llms) -> dict:
    """Configurations one at a time (each LLM freed before the next loads: quality needs no
    alternation, its figures do not depend on the host's load)."""
    from jaxserve.llm import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    configs, ref, inputs = [], None, None
    for opts in args.engine_opts or [{}]:
        with ExitStack() as stack:
            (llm,), (cfg,) = build_llms(args, stack, [opts])
            wins, prompts = inputs = inputs or _inputs(args, llm)
            row: dict = {}
            if args.windows:
                row["heldout_loss"] = heldout_loss(llm, wins[: args.windows, : args.seq_len + 1])
            if prompts:
                outs = [o.token_ids for o in llm.generate(prompts, params)]
                ref = ref or outs
                row.update(agreement(outs, ref))
            row["compiles_since_warmup"] = llm.compiles_since_warmup()
            del llm
        if configs and "heldout_loss" in row:
            row["loss_vs_first"] = row["heldout_loss"] / configs[0]["quality"]["heldout_loss"] - 1
        configs.append({"label": cfg.label, "spec": cfg.spec, "quality": row})
        print(_line(cfg.label, row, configs[0]["label"]), flush=True)
    workload = {"windows": args.windows, "seq_len": args.seq_len, "num_prompts": args.num_prompts,
                "prompt_len": args.prompt_len, "output_len": args.output_len, "random_prompts": args.random_prompts,
                "text": args.text or "stdlib held-out split"}  # fmt: skip
    return result.document("quality", argv, workload=workload, configs=configs)


def _line(label: str, row: dict, first: str) -> str:
    parts = []
    if "heldout_loss" in row:
        vs = f" ({row['loss_vs_first']:+.4%} vs {first})" if "loss_vs_first" in row else ""
        parts.append(f"held-out loss {row['heldout_loss']:.5f}{vs}")
    if "identical_completions" in row:
        parts.append(
            f"greedy vs {first}: {row['identical_completions']} identical, {row['token_agreement']:.1%} of tokens "
            f"equal, first difference at token {row['mean_first_difference']:.1f} on average"
        )
    return f"{label}: " + "; ".join(parts) + f"; compiles since warm-up {row['compiles_since_warmup']}"
