"""Two processes on 127.0.0.1, each with 2 CPU devices, run the engine over one 4-device
mesh through jax.distributed (gloo collectives) and match a single process's greedy outputs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import make_hf_model

REPO = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(r"""
    import json, sys
    from jaxserve import multihost
    path, port, pid, nproc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if nproc > 1:
        multihost.initialize(f"127.0.0.1:{port}", nproc, pid, local_device_count=2)
    import jax, numpy as np
    from jaxserve import LLM, SamplingParams
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 40)))] for _ in range(6)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 20, 6)]
    llm = LLM(path, tensor_parallel_size=4 if nproc > 1 else 1, max_slots=4, page_size=8, max_model_len=96,
              num_pages=64, prefill_buckets=(16, 32, 64))
    if jax.process_index() == 0:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        print("RESULT" + json.dumps({"tokens": outs, "devices": jax.device_count(),
                                     "kv_shard": list(llm.engine.target.kv[0][0].addressable_shards[0].data.shape)}))
    else:
        print("FOLLOWER_DONE", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path, nproc):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(path), str(port), str(i), str(nproc)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for i in range(nproc)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT")]
    assert line, outs[0][0][-2000:] + outs[0][1][-3000:]
    if nproc > 1:
        assert "FOLLOWER_DONE" in outs[1][0]
    return json.loads(line[0][6:])


def test_two_processes_match_one(tmp_path):
    make_hf_model("llama", tmp_path, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128)
    single = _run(tmp_path, 1)
    multi = _run(tmp_path, 2)
    assert multi["devices"] == 4
    assert multi["kv_shard"] == [64, 8, 1, 8]  # 4 KV heads over 4 devices in 2 processes
    assert multi["tokens"] == single["tokens"]
