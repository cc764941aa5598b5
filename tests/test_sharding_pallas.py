"""Tensor parallelism on the Pallas kernels (interpreted here, 4 CPU devices in a subprocess):
each chip runs them under shard_map on its own heads, with the same tokens as one device and no
step gathering the page pool; the real kernels (Mosaic, Triton) export for a 4-chip mesh. The
XLA path is in test_sharding.py (two files: `--dist loadfile` runs them on different workers)."""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_devices, tp_models

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from jaxserve import LLM, SamplingParams
    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 50)))] for _ in range(10)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 25, 10)]
    # A second round: each prompt again with 5 more tokens. Its whole pages are in the prefix
    # cache, so it resumes from them (the "context" step kind; a partial page is copied on write).
    more = np.random.default_rng(1)
    again = [p + [int(x) for x in more.integers(3, 512, 5)] for p in prompts]
    opts = dict(max_slots=4, page_size=8, max_model_len=128, num_pages=96, token_buckets=(64,))
    out = {}
    # Pallas kernels (interpreted here) run per chip under shard_map: same tokens as tp=1 (the
    # CPU's default attention), and no step gathers the page pool (XLA cannot split a kernel's
    # custom call on TPU/GPU). No warm-up: every engine compiles the shapes this workload runs,
    # which are the executables inspected. One token bucket: each interpreted kernel's compile
    # is ~6 s, and the bucket a step lands in changes nothing per chip.
    for name, path, n in (("pallas", sys.argv[1], len(prompts)), ("pallas_few_kv_heads", sys.argv[2], 4)):
        out[name] = {}
        for tp in (1, 2, 4):
            kernel = dict(attention_impl="pallas", interpret=True) if tp > 1 else {}
            llm = LLM(path, tensor_parallel_size=tp, warmup=False, **kernel, **opts)
            toks = [o.token_ids for o in llm.generate(prompts[:n], params[:n])]
            toks += [o.token_ids for o in llm.generate(again[:n], params[:n])]
            t = llm.runner.target
            steps = {s: len(getattr(t, s)) for s in ("step",)}
            # an all-gather of the page pool ([96 pages, 8, ...]); the sampler's top-k for logprobs
            # gathers a row of the vocabulary, which is its job
            gathers = sum(
                "all-gather" in line and "[96,8," in line
                for s in steps for exe in getattr(t, s).executables() for line in exe.as_text().splitlines()
            )
            out[name][tp] = {"tokens": toks, "steps": steps, "gathers": gathers, "impl": llm.runner.attention_impl,
                             "hits": llm.prefix_cache.hit_tokens}
    # The real kernels (Mosaic for TPU, Triton for GPU) under shard_map, exported for a 4-chip
    # mesh: each chip's program holds the kernel and nothing gathers the pool.
    import functools
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxserve.parallel import sharding as shd
    from jaxserve.models.model_config import ModelConfig
    from pallas_kernels import ragged_paged_attention as rpa, reference
    cfg = ModelConfig("LlamaForCausalLM", 512, 512, 1024, 1, 8, 8, 64, 1e-5, 1e4, 2048)
    mesh = shd.make_mesh(4)
    H = P(None, None, shd.AXIS, None)
    sd = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    bf, i32 = jnp.bfloat16, jnp.int32
    # a ragged step of 24 tokens in 8 rows: q/k/v [1, 24, H, D] as the model passes them (split
    # by heads), pages, then
    # slot_mapping [24], block tables [8, 16], seq_lens [8], query_start_loc [9], positions [24]
    args = (sd((1, 24, 8, 64), bf, H), sd((1, 24, 8, 64), bf, H), sd((1, 24, 8, 64), bf, H), sd((64, 16, 8, 64), bf, H),
            sd((64, 16, 8, 64), bf, H), sd((24,), i32, P()), sd((8, 16), i32, P()), sd((8,), i32, P()),
            sd((9,), i32, P()), sd((24,), i32, P()))
    out["export"] = {}
    for platform, backend, marker in (("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")):
        from jaxserve.runner.attention import paged_forward
        # the pallas backend's forward, with the lowering named instead of the host's
        kernel = functools.partial(rpa.ragged_paged_attention, interpret=False, backend=backend)
        fn = shd.shard_attention(paged_forward(kernel), cfg, mesh)
        skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        attend = lambda q, k, v, kp, vp, slots, bt, sl, qsl, pos: fn(  # noqa: E731
            q, k, v, (kp, vp), reference.RaggedMetadata(slots, bt, sl, qsl, pos), scale=0.125)
        exp = jax.export.export(jax.jit(attend), platforms=[platform], disabled_checks=skip)(*args)
        text = exp.mlir_module()
        out["export"][platform] = {"devices": exp.nr_devices, "kernel": marker in text, "gather": "all_gather" in text}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_devices(SCRIPT, 4, *tp_models(tmp_path_factory))


@pytest.mark.parametrize("tp", [2, 4])
def test_pallas_kernels_run_per_chip(results, tp):
    for name in ("pallas", "pallas_few_kv_heads"):
        r, ref = results[name][str(tp)], results[name]["1"]
        assert r["impl"] == "pallas" and ref["impl"] != "pallas"
        assert r["tokens"] == ref["tokens"], name
        assert r["hits"] > 0, f"{name}: the second round missed the prefix cache"
        assert all(n > 0 for n in r["steps"].values()), f"{name}: a step kind never ran: {r['steps']}"
        assert r["gathers"] == 0, f"{name}: {r['gathers']} steps gather the page pool across chips"


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sharded_kernels_export_for_accelerators(results, platform):
    assert results["export"][platform] == {"devices": 4, "kernel": True, "gather": False}
