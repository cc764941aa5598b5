"""Speculative decoding against plain decoding, in one run, on the shipped target and draft.

Workloads (greedy, 128 new tokens each):
- code: code prompts cut from Python's standard library; the shipped draft proposes;
- editing: a function followed by the start of its own copy, so the output repeats much of
  the prompt; prompt lookup (n-gram) proposes.
At batch 1 (requests one after another) and batch 8 (8 at once). Reports output tokens/s,
the speedup over plain decoding, mean tokens emitted per target step and acceptance by draft
position. Outputs are checked equal to plain decoding's.

    .venv/bin/python scripts/bench_speculative.py [--k 4] [--requests 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def code_prompts(n: int) -> list[str]:
    import difflib
    import json as json_mod
    import textwrap

    out = []
    for mod in (textwrap, difflib, json_mod.decoder, statistics):
        src = inspect.getsource(mod)
        for i in range(0, len(src) - 400, len(src) // 6):
            out.append(src[i : i + 300])
    return out[:n]


def editing_prompts(n: int) -> list[str]:
    import textwrap

    funcs = [
        inspect.getsource(f)
        for f in (
            textwrap.dedent,
            textwrap.indent,
            textwrap.shorten,
            textwrap.fill,
            statistics.median,
            statistics.mode,
            statistics.variance,
            json.dumps,
        )
    ]
    return [f"{f}\n\n# The same function, unchanged:\n{f.splitlines()[0]}\n" for f in funcs[:n]]


def run(llm, prompts, batch: int, max_tokens: int):
    from jaxserve import SamplingParams

    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], p)
    secs = time.perf_counter() - t0
    return secs, [o.token_ids for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from jaxserve import LLM

    # jaxserve's small trained model and its draft (the draft shares its tokenizer)
    small = REPO / "assets" / "models" / "default"

    opts = dict(max_slots=8, max_model_len=1024, enable_prefix_caching=False)
    engines = {
        "plain": LLM(str(small / "target"), **opts),
        "draft": LLM(
            str(small / "target"), speculative_model=str(small / "draft"), num_speculative_tokens=args.k, **opts
        ),
        "ngram": LLM(str(small / "target"), speculative_model="ngram", num_speculative_tokens=args.k, **opts),
    }
    workloads = {"code": code_prompts(args.requests), "editing": editing_prompts(args.requests)}
    rows = []
    for wname, prompts in workloads.items():
        for batch in (1, 8):
            base_s, base_out = run(engines["plain"], prompts, batch, args.max_tokens)
            for spec in ("draft", "ngram"):
                llm = engines[spec]
                llm.spec_stats.reset()
                secs, out = run(llm, prompts, batch, args.max_tokens)
                st = llm.stats()
                row = {
                    "workload": wname,
                    "batch": batch,
                    "proposer": spec,
                    "plain_s": base_s,
                    "spec_s": secs,
                    "speedup": base_s / secs,
                    "tokens_per_target_step": st["spec_mean_accepted"],
                    "acceptance_by_position": st["spec_acceptance_by_position"],
                    "identical_outputs": f"{sum(a == b for a, b in zip(out, base_out))}/{len(out)}",
                }
                rows.append(row)
                print(
                    f"{wname:8s} batch {batch}  {spec:5s}: plain {base_s:6.2f}s  spec {secs:6.2f}s  "
                    f"speedup {row['speedup']:.2f}x  tokens/target step {row['tokens_per_target_step']:.2f}  "
                    f"accept by pos {[round(a, 2) for a in row['acceptance_by_position']]}  "
                    f"identical {row['identical_outputs']}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
