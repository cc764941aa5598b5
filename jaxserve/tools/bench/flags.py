"""The flags `jaxserve bench` subcommands share, and their argument types (a bad value exits 2
with argparse's usage message)."""

from __future__ import annotations

import argparse
import json

from jaxserve.tools.bench.workload import KINDS


def int_range(text: str) -> tuple[int, int]:
    """'N' or 'LOW-HIGH' (inclusive)."""
    try:
        lo, _, hi = text.partition("-")
        return (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from None


def shape(text: str) -> tuple[int, int, int]:
    """'LAYERS,HIDDEN,VOCAB'."""
    try:
        layers, hidden, vocab = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYERS,HIDDEN,VOCAB, got {text!r}") from None
    if min(layers, hidden, vocab) < 1 or hidden % 4:
        raise argparse.ArgumentTypeError(f"expected positive sizes, HIDDEN a multiple of 4, got {text!r}")
    return layers, hidden, vocab


def json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of LLM options, got {text!r}")
    return v


def _above_zero(text: str, parse, expected: str, bound: str):
    try:
        v = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
    return v


def rate(text: str) -> float:
    return _above_zero(text, float, "requests/s or inf", "> 0")


def positive(text: str) -> int:
    return _above_zero(text, int, "a positive integer", ">= 1")


def workload_flags(p: argparse.ArgumentParser, *, kind: str, n: int, plen: str, olen: str, rounds: int = 3) -> None:
    """Lengths left out take the subcommand's defaults, or long-short's (short prompts 48-256,
    outputs 64-160)."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=KINDS, default=kind, help=f"the kind of requests (default {kind})")
    g.add_argument("--workload-file", metavar="FILE.json", help="a JSON workload (implies --workload json)")
    g.add_argument("--num-requests", type=positive, default=n, help=f"requests per round (default {n})")
    g.add_argument("--prompt-len", type=int_range, metavar="N|LO-HI", help=f"default {plen} (long-short: 48-256)")
    g.add_argument("--output-len", type=int_range, metavar="N|LO-HI", help=f"default {olen} (long-short: 64-160)")
    g.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix, prefix-groups: shared tokens (default 1024)"
    )
    g.add_argument("--num-groups", type=positive, default=8, help="prefix-groups: distinct prefixes (default 8)")
    g.add_argument("--long-fraction", type=float, default=0.25, help="long-short: share of long prompts (0.25)")
    g.add_argument("--long-len", type=int_range, default=(1200, 1800), metavar="LO-HI", help="long-short: 1200-1800")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; OpenAI clients send 1.0")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--rounds", type=positive, default=rounds, help=f"each configuration once per round ({rounds})")
    p.set_defaults(default_lengths=(int_range(plen), int_range(olen)))


def gin_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gin configuration (the base engine options; --engine-opts override them)")
    g.add_argument("--gin_file", "--gin-file", dest="gin_file", action="append", default=[], metavar="FILE")
    g.add_argument("--gin_param", "--gin-param", dest="gin_param", action="append", default=[], metavar="BINDING")


def engine_flags(p: argparse.ArgumentParser, *, compare: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or GGUF file (default: the default model); 'workload' builds the random "
        "Llama a JSON workload's `model` field describes (needs torch); FILE.json builds that file's",
    )
    if compare:
        g.add_argument(
            "--engine-opts",
            action="append",
            type=json_object,
            default=[],
            metavar="JSON",
            help="LLM(...) options as a JSON object, e.g. '{\"max_slots\": 64}'; repeat it to compare "
            "configurations (rounds alternate between them)",
        )
    else:
        g.add_argument(
            "--engine-opts", type=json_object, default={}, metavar="JSON", help="LLM(...) options of every side"
        )
    gin_flags(p)


def out_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="FILE.json", help="write the result JSON here (schema: docs/benchmarks.md)")
