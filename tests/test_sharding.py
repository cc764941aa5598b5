"""Tensor parallelism on 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8,
set by this module's subprocess so the rest of the suite keeps one device), on the CPU's
default attention. The Pallas kernels under tensor parallelism are in test_sharding_pallas.py:
two files, so that `--dist loadfile` runs the two subprocesses on different workers."""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_devices, tp_models

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.executable_cache import compile_count
    from jaxserve.runner.step_batch import Chunk
    assert len(jax.devices()) == 8, jax.devices()
    path = sys.argv[1]
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 50)))] for _ in range(10)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 25, 10)]
    # two token buckets (decodes, prompts): each engine's warm-up compiles every one, per tp
    opts = dict(max_slots=4, page_size=8, max_model_len=128, num_pages=96, token_buckets=(16, 64))
    out = {}
    # Restart with the executable store, first of all: XLA:CPU cannot serialize a sort that
    # already ran, and later engines here would get the sampler from jax's in-process cache.
    import tempfile
    store_dir = tempfile.mkdtemp()
    for run in ("first", "second"):
        llm = LLM(path, tensor_parallel_size=2, compilation_cache_dir=store_dir, **opts)
        st = llm.runner.store
        out["restart_" + run] = {"saved": st.saved, "loaded": st.loaded,
                                 "tokens": [o.token_ids for o in llm.generate(prompts, params)]}
    ref = None
    for tp in (1, 2, 4, 8):
        llm = LLM(path, tensor_parallel_size=tp, **opts)
        t = llm.runner.target
        # logits of one decode step after a prefill, against tp=1
        llm.runner.prefill([Chunk(prompts[0][:-1], 0, list(range(1, 8)))])
        row = Chunk([prompts[0][-1]], len(prompts[0]) - 1, list(range(1, 8)), (0.0, 0, 1.0, 0, 0))
        r = llm.runner.step([row], True)  # the top logprobs of the next token stand in for the logits
        logits = np.asarray(r.top_logprobs)[0]
        if ref is None:
            ref = logits
        before = compile_count()
        toks = [o.token_ids for o in llm.generate(prompts, params)]
        shards = {
            # tp=1 packs its weights for the CPU's native matmul ("packed"); TP keeps "kernel"
            "q_proj": [tuple(sh.data.shape) for sh in t.state["layers"][0]["self_attn"]["q_proj"]["kernel" if tp > 1 else "packed"].get_value().addressable_shards][:1],
            "down_proj": [tuple(sh.data.shape) for sh in t.state["layers"][0]["mlp"]["down_proj"]["kernel" if tp > 1 else "packed"].get_value().addressable_shards][:1],
            "kv": [tuple(sh.data.shape) for sh in t.kv[0][0].addressable_shards][:1],
            "n_devices": len(t.kv[0][0].sharding.device_set),
        }
        out[tp] = {"err": float(np.abs(logits - ref).max()), "tokens": toks, "shards": shards,
                   "compiles": compile_count() - before}
    # Fewer KV heads (2) than chips (4): K/V projections and pages are replicated. tp=1 is the
    # reference only (no warm-up: it compiles the shapes this workload runs, nothing else).
    few = {}
    for tp in (1, 4):
        llm = LLM(sys.argv[2], tensor_parallel_size=tp, warmup=tp > 1, **opts)
        before = compile_count()
        few[tp] = {"tokens": [o.token_ids for o in llm.generate(prompts[:4], params[:4])],
                   "kv": [tuple(sh.data.shape) for sh in llm.runner.target.kv[0][0].addressable_shards][:1],
                   "compiles": compile_count() - before}
    out["few_kv_heads"] = few
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_devices(SCRIPT, 8, *tp_models(tmp_path_factory))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_logits_match_single_device(results, tp):
    assert results[tp]["err"] < 1e-4


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_greedy_outputs_identical(results, tp):
    assert results[tp]["tokens"] == results[1]["tokens"]
    assert results[tp]["compiles"] == 0


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_parameters_and_pages_are_sharded(results, tp):
    sh = results[tp]["shards"]
    assert sh["q_proj"] == [[64, 64 // tp]]  # columns (heads) split
    assert sh["down_proj"] == [[128 // tp, 64]]  # rows split
    assert sh["kv"] == [[96, 8, 8 // tp, 8]]  # pages split by KV head
    assert sh["n_devices"] == tp


def test_fewer_kv_heads_than_chips_replicates_kv(results):
    few = results["few_kv_heads"]
    assert few["4"]["tokens"] == few["1"]["tokens"]
    assert few["4"]["kv"] == [[96, 8, 2, 8]]  # every chip holds both KV heads
    assert few["4"]["compiles"] == 0


def test_restart_loads_sharded_executables(results):
    first, second = results["restart_first"], results["restart_second"]
    assert first["saved"] > 0 and first["loaded"] == 0
    assert second["loaded"] == first["saved"] and second["saved"] == 0
    assert first["tokens"] == second["tokens"] == results[1]["tokens"]
