"""Two processes on 127.0.0.1, each with 2 CPU devices, run the engine over one 4-device
mesh through jax.distributed (gloo collectives) and match a single process's greedy outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TEST_MODEL, free_port, make_hf_model, suite_xla_flags

from jaxserve.parallel import multihost

# The pieces of Gloo's "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected
# peer ranks is : 1" lines, in any order.
GLOO_NOISE = re.compile(
    r"(\[Gloo\] Rank |\d+| is connected to | peer ranks\. |Expected number of connected peer ranks is : |\n)*"
)

REPO = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(r"""
    import json, sys
    from jaxserve.parallel import multihost
    path, port, pid, nproc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if nproc > 1:
        multihost.initialize(f"127.0.0.1:{port}", nproc, pid, local_device_count=2)
    import jax, numpy as np
    from jaxserve import LLM, SamplingParams
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 40)))] for _ in range(6)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 20, 6)]
    # No warm-up: every process compiles the shapes this workload runs, in the leader's order
    # (the CLI test below starts warmed-up engines).
    llm = LLM(path, tensor_parallel_size=4 if nproc > 1 else 1, max_slots=4, page_size=8, max_model_len=96,
              num_pages=64, token_buckets=(16, 32, 64), warmup=False)
    if jax.process_index() == 0:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        print("RESULT" + json.dumps({"tokens": outs, "devices": jax.device_count(),
                                     "kv_shard": list(llm.runner.target.kv[0][0].addressable_shards[0].data.shape)}))
    else:
        print("FOLLOWER_DONE", flush=True)
""")


def _run(path, nproc):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = suite_xla_flags()  # one device per process
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(path), str(port), str(i), str(nproc)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(nproc)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT")]
    assert line, outs[0][0][-2000:] + outs[0][1][-3000:]
    if nproc > 1:
        assert "FOLLOWER_DONE" in outs[1][0]
    return json.loads(line[0][6:])


def test_two_processes_match_one(tmp_path):
    make_hf_model(
        "llama", tmp_path, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128
    )
    single = _run(tmp_path, 1)
    multi = _run(tmp_path, 2)
    assert multi["devices"] == 4
    assert multi["kv_shard"] == [64, 8, 1, 8]  # 4 KV heads over 4 devices in 2 processes
    assert multi["tokens"] == single["tokens"]


def test_the_cli_joins_processes_from_the_environment(tmp_path):
    """`jaxserve generate` started the same way in two processes (as the launch scripts start
    `serve` on every worker of a slice, and a LeaderWorkerSet every pod of a group), told apart
    only by LWS_WORKER_INDEX: process 0
    prints the completion of a 4-chip mesh, process 1 replays its steps and exits 0, and the
    text equals one process on one device."""
    args = [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "generate",
        "--model",
        str(TEST_MODEL),
        "--max-tokens",
        "12",
        "--max-slots",
        "4",
        "--max-model-len",
        "128",
        "--gin_param",
        "ServeConfig.token_buckets = (16, 32)",
        "--compilation-cache-dir",
        str(tmp_path / "xla"),
        "def fibonacci(n):",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSERVE_CACHE_DIR=str(tmp_path / "converted"))
    env["XLA_FLAGS"] = suite_xla_flags()  # one device per process
    single = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert single.returncode == 0, single.stderr[-3000:]
    port = free_port()
    procs = [
        subprocess.Popen(
            args + ["--tensor-parallel-size", "4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            # A LeaderWorkerSet group of two pods (deploy/k8s, docs/scaling.md): LWS's own
            # variables, the coordinator on the leader at JAXSERVE_COORDINATOR_PORT.
            env=dict(
                env,
                LWS_LEADER_ADDRESS="127.0.0.1",
                LWS_GROUP_SIZE="2",
                LWS_WORKER_INDEX=str(i),
                JAXSERVE_COORDINATOR_PORT=str(port),
                JAXSERVE_LOCAL_DEVICE_COUNT="2",
            ),
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o[-2000:] + e[-4000:]
    assert "process 0 of 2; 4 global devices" in outs[0][1] and "process 1 of 2" in outs[1][1]
    assert single.stdout.startswith("def fibonacci(n):")
    # Gloo prints its connection messages to stdout, piece by piece from several threads, so
    # they can interleave ("[Gloo] Rank [Gloo] Rank 0 is connected ..."): before the completion
    # each process's stdout may hold those pieces and nothing else.
    cut = len(outs[0][0]) - len(single.stdout)
    noise, completion = outs[0][0][:cut], outs[0][0][cut:]
    assert completion == single.stdout
    assert GLOO_NOISE.fullmatch(noise), outs[0][0][:500]
    assert GLOO_NOISE.fullmatch(outs[1][0]), outs[1][0][:500]


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, (None, None, None)),
        (
            {"JAXSERVE_COORDINATOR": "10.0.0.2:9000", "JAXSERVE_NUM_PROCESSES": "4", "JAXSERVE_PROCESS_ID": "3"},
            ("10.0.0.2:9000", 4, 3),
        ),
        ({"JAXSERVE_COORDINATOR": "auto"}, ("auto", None, None)),
        ({"LWS_LEADER_ADDRESS": "g-0.g", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}, ("g-0.g:8476", 4, 2)),
        (
            {
                "LWS_LEADER_ADDRESS": "g-0.g",
                "LWS_GROUP_SIZE": "2",
                "LWS_WORKER_INDEX": "0",
                "JAXSERVE_COORDINATOR_PORT": "7000",
            },
            ("g-0.g:7000", 2, 0),
        ),
        ({"LWS_LEADER_ADDRESS": "g-0.g", "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}, (None, None, None)),
        # JAXSERVE_COORDINATOR wins over LWS (e.g. "auto" on a TPU slice: jax's own detection)
        (
            {
                "JAXSERVE_COORDINATOR": "auto",
                "LWS_LEADER_ADDRESS": "g-0.g",
                "LWS_GROUP_SIZE": "4",
                "LWS_WORKER_INDEX": "1",
            },
            ("auto", None, None),
        ),
    ],
)
def test_the_coordinator_comes_from_jaxserve_or_leaderworkerset_variables(env, want):
    assert multihost.coordinator_from_env(env) == want


@pytest.mark.parametrize(
    "env, message",
    [
        ({"LWS_LEADER_ADDRESS": "g-0.g", "LWS_GROUP_SIZE": "two", "LWS_WORKER_INDEX": "0"}, "LWS_GROUP_SIZE"),
        ({"LWS_LEADER_ADDRESS": "g-0.g", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"}, "LWS_WORKER_INDEX"),
        ({"LWS_LEADER_ADDRESS": "g-0.g"}, "LWS_GROUP_SIZE"),
        ({"JAXSERVE_COORDINATOR": "h:1", "JAXSERVE_NUM_PROCESSES": "0"}, "JAXSERVE_NUM_PROCESSES"),
    ],
)
def test_a_malformed_variable_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        multihost.coordinator_from_env(env)
