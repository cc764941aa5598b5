"""Prompts for `jaxserve bench speculative`, cut from Python's standard library (present wherever
Python is, so the bench needs no data files).

- code: stretches of library source: a draft model trained on code proposes well here;
- editing: a function, then the start of its own copy: the output repeats the prompt, the case
  prompt lookup (n-gram drafting) is for.
"""

from __future__ import annotations

import difflib
import inspect
import json
import statistics
import textwrap


def code_prompts(n: int) -> list[str]:
    out = []
    for mod in (textwrap, difflib, json.decoder, statistics):
        src = inspect.getsource(mod)
        out += [src[i : i + 300] for i in range(0, len(src) - 400, len(src) // 6)]
    return (out * (n // len(out) + 1))[:n]


def editing_prompts(n: int) -> list[str]:
    funcs = [
        textwrap.dedent,
        textwrap.indent,
        textwrap.shorten,
        textwrap.fill,
        statistics.median,
        statistics.mode,
        statistics.variance,
        json.dumps,
    ]
    out = []
    for f in funcs:
        src = inspect.getsource(f)
        out.append(f"{src}\n\n# The same function, unchanged:\n{src.splitlines()[0]}\n")
    return (out * (n // len(out) + 1))[:n]


def prompts(kind: str, n: int) -> list[str]:
    return code_prompts(n) if kind == "code" else editing_prompts(n)
