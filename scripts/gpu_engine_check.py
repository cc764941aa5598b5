"""On a GPU: the engine on the ragged Pallas kernel (Triton, compiled) against the same engine
on the XLA attention path, greedy, float32 at the highest matmul precision, so the two differ
only by summation order. Prints how many of the requests' tokens agree. No warm-up: each
engine compiles only the steps the requests run (`jaxserve bench throughput` covers warm engines).

    JAX_PLATFORMS=cuda python scripts/gpu_engine_check.py MODEL [--requests 8] [--tokens 16]

MODEL: a checkpoint, or a JSON workload with a `model` field (its random Llama is built first).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    model = args.model
    if model.endswith(".json"):
        from jaxserve.tools.bench.workload import model_from_spec

        model = str(model_from_spec(json.loads(Path(model).read_text())["model"], Path(tempfile.mkdtemp())))
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 32000, int(n))] for n in rng.integers(16, 500, args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    # few step shapes: on 2026-12-04 the XLA engine's cold compiles of the default buckets at the
    # highest precision outlasted an 80-second limit
    opts = dict(
        dtype="float32",
        max_slots=16,
        max_model_len=1024,
        token_buckets=(16, 256),
        kv_cache_memory_bytes=2 << 30,
        warmup=False,
    )
    out = {}
    for impl in ("xla", "pallas"):
        llm = LLM(model, attention_impl=impl, **opts)
        out[impl] = [r.token_ids for r in llm.generate(prompts, params)]
        print(f"{impl}: attention {llm.runner.attention_impl}", flush=True)
        del llm
    same = sum(a == b for a, b in zip(out["xla"], out["pallas"]))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(out["xla"], out["pallas"])
    ]
    print(
        f"greedy float32, {args.requests} requests x {args.tokens} tokens: {same}/{args.requests} identical; "
        f"agreeing prefix median {int(np.median(prefix))}, min {min(prefix)}"
    )


if __name__ == "__main__":
    main()
