"""A tied model's LM head as XLA's float32 dot over the embedding against its own packed copy
(LlamaForCausalLM.untie_lm_head, which the runner calls before packing for the native matmul),
side by side in one process on the default model (SmolLM2-135M: 49,152 x 576 tied rows).

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_tied_head.py [--rounds 3]

One engine untied (today's path), one with untie_lm_head a no-op (the path before); rounds
alternate; each time is the median of 8 steps of 1, 5 and 16 tokens of one row at context
250 (1: a decode step; 5: a speculative verify at k = 4). The bound is bytes / bandwidth:
the step's weights (bfloat16 layers + the LM head in its dtype) over the measured stream rate.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve import LLM
from jaxserve.models import llama
from jaxserve.runner.step_batch import Chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    untied = LLM(max_slots=4, enable_prefix_caching=False)
    keep = llama.LlamaForCausalLM.untie_lm_head
    llama.LlamaForCausalLM.untie_lm_head = lambda self: None
    tied = LLM(max_slots=4, enable_prefix_caching=False)
    llama.LlamaForCausalLM.untie_lm_head = keep
    pages = list(range(1, 1 + 512 // 16 + 2))
    ctx = 250
    for llm in (untied, tied):
        llm.core.runner.prefill([Chunk(list(np.arange(ctx) % 1000 + 5), 0, pages)])
    res: dict = {}
    for _ in range(args.rounds):
        for name, llm in (("untied", untied), ("tied", tied)):
            r = llm.core.runner
            for n in (1, 5, 16):
                ts = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    r.step([Chunk([7] * n, ctx, pages, (0.0, 0, 1.0, 0, 0))])
                    ts.append(time.perf_counter() - t0)
                res.setdefault((n, name), []).append(float(np.median(ts[2:])) * 1e3)
    cfg = untied.model_cfg
    layers = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) * 2  # bfloat16 panels
    head = {"untied": cfg.vocab_size * cfg.hidden_size * 2, "tied": cfg.vocab_size * cfg.hidden_size * 4}
    for n in (1, 5, 16):
        a, b = np.median(res[(n, "untied")]), np.median(res[(n, "tied")])
        print(
            f"{n:>2} tokens: untied {a:.2f} ms ({(layers + head['untied']) / 2**20:.0f} MiB read), "
            f"tied {b:.2f} ms ({(layers + head['tied']) / 2**20:.0f} MiB): {b / a:.2f}x  "
            f"(rounds untied {[round(x, 2) for x in res[(n, 'untied')]]}, tied {[round(x, 2) for x in res[(n, 'tied')]]})"
        )


if __name__ == "__main__":
    main()
