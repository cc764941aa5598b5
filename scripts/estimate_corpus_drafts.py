"""Would drafts looked up in a corpus of the default model's own replies pay on chat?

SuffixDecoding (vLLM's `method="suffix"`) drafts from a suffix tree over earlier outputs as well
as the request's own tokens. This estimates what a shipped corpus would give SmolLM2 before
building it: the target's greedy replies to scripts/train_eagle.py's prompts (training and
held-out docstring prompts, 850) are the corpus, the bench's held-out chat questions
(`jaxserve bench speculative --prompts chat`, 128 tokens) are replayed against it, and each
step drafts the most frequent continuation of the longest matching suffix, token by token.

    .venv/bin/python scripts/estimate_corpus_drafts.py --work /tmp/corpus   # ~7 min, then cached

Prints tokens per target step and a speedup estimate from a verify's measured cost (a k = 3
verify is ~1.25x a plain step on the AVX2 host in float32).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def replies(work: Path) -> dict:
    f = work / "replies.json"
    if f.exists():
        return json.loads(f.read_text())
    from train_eagle import prompts

    from jaxserve import LLM, SamplingParams
    from jaxserve.tools.bench.speculative import CHAT_QUESTIONS

    train, held = prompts()
    llm = LLM(max_slots=16)
    out = {}
    for name, ps, n in (("bench", CHAT_QUESTIONS, 128), ("corpus", train + held, 192)):
        outs = llm.chat([[{"role": "user", "content": p}] for p in ps], SamplingParams(max_tokens=n, temperature=0.0))
        out[name] = [list(o.token_ids) for o in outs]
    work.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(out))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/corpus")
    ap.add_argument("--max-n", type=int, default=6, help="longest suffix matched")
    args = ap.parse_args()
    d = replies(Path(args.work))
    table: dict[tuple, Counter] = defaultdict(Counter)
    for seq in d["corpus"]:
        for i in range(1, len(seq)):
            for n in range(1, min(args.max_n, i) + 1):
                table[tuple(seq[i - n : i])][seq[i]] += 1

    def propose(ctx: list[int], k: int, min_n: int, tau: float) -> list[int]:
        out, c = [], list(ctx)
        for _ in range(k):
            nxt = None
            for n in range(min(args.max_n, len(c)), min_n - 1, -1):
                cnt = table.get(tuple(c[-n:]))
                if cnt:
                    tok, f = cnt.most_common(1)[0]
                    nxt = tok if f / sum(cnt.values()) >= tau else None
                    break
            if nxt is None:
                break
            out.append(nxt)
            c.append(nxt)
        return out

    print(f"corpus {sum(map(len, d['corpus']))} tokens; held-out {sum(map(len, d['bench']))} tokens")
    for k in (3, 5):
        for min_n, tau in ((1, 0.0), (2, 0.0), (2, 0.5), (3, 0.7)):
            toks = steps = cost = 0.0
            for seq in d["bench"]:
                i = 0
                while i < len(seq):
                    p = propose(seq[:i], k, min_n, tau)
                    a = 0
                    while a < len(p) and i + a < len(seq) and p[a] == seq[i + a]:
                        a += 1
                    i += a + 1
                    toks, steps = toks + a + 1, steps + 1
                    cost += 1.0 if not p else 1.0 + 0.08 * (len(p) + 1)
            print(f"k={k} min suffix {min_n} min share {tau}: {toks / steps:.2f} tokens a step, ~{toks / cost:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
