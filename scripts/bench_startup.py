"""Start-up time of `LLM()` (the default model, SmolLM2-135M-Instruct): cold (empty converted-
weight, tokenizer and compilation caches) then warm (the same caches), each in a fresh process.

    python scripts/bench_startup.py                    # LLM() with the engine's defaults
    python scripts/bench_startup.py --model DIR_OR_GGUF --engine '{"max_slots": 4}'

Prints, for each start, the seconds to import jaxserve, to load the weights (dequantize or restore),
to the KV pool (tokenizer, runner), and for the warm-up (compile or load every bucket).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, logging, sys, time
t0 = time.perf_counter()
marks = {}
class Marks(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        for key, pat in (("weights", "GGUF tensors|restored converted|loaded shard"), ("kv_pool", "KV cache:"),
                         ("warmup", "warm-up compiled")):
            if key not in marks and __import__("re").search(pat, msg):
                marks[key] = round(time.perf_counter() - t0, 1)
        m = __import__("re").search(r"\((\d+) executables loaded.*?(\d+) compiled", msg)
        if m:
            marks["loaded/compiled"] = f"{m.group(1)}/{m.group(2)}"
logging.getLogger("jaxserve").addHandler(Marks())
logging.getLogger("jaxserve").setLevel(logging.INFO)
from jaxserve import LLM
marks["import"] = round(time.perf_counter() - t0, 1)
model, engine = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(model, log_progress=True, compilation_cache_dir=sys.argv[3], **engine)
marks["ready"] = round(time.perf_counter() - t0, 1)
print("RESULT" + json.dumps(marks), flush=True)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    ap.add_argument("--engine", default="{}", help="engine options as JSON")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="jaxserve-startup-")
    env = dict(os.environ, JAXSERVE_CACHE_DIR=os.path.join(root, "cache"), JAX_PLATFORMS="cpu")
    rows = {}
    for run in ("cold", "warm"):
        t = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(args.model), args.engine, os.path.join(root, "xla")],
            env=env,
            capture_output=True,
            text=True,
        )
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
        if not line:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        rows[run] = json.loads(line[0][6:])
        rows[run]["process"] = round(time.perf_counter() - t, 1)
        print(run, json.dumps(rows[run]), flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
