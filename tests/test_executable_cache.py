"""The executable store: a restart loads every compiled step instead of tracing and compiling
it, produces the same tokens, and misses (compiles afresh) whenever anything that shapes an
executable changes; unreadable files are recompiled and replaced."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from conftest import TEST_MODEL, hf_greedy

from jaxserve import LLM, SamplingParams
from jaxserve.runner import executable_cache as xc
from jaxserve.runner.executable_cache import compile_count, trace_count

# The store is what this file tests: it must see every compile, none restored from JAX's cache.
pytestmark = pytest.mark.no_suite_xla_cache

GREEDY = dict(temperature=0, ignore_eos=True)
# 11 slots: one batch bucket of 11, a shape no other test compiles (test_speculative and
# test_prefix_caching use 6, and may run earlier in the same worker). XLA:CPU cannot serialize a
# sort it has already executed, and jax's in-process cache returns the same executable to every
# engine in the process that compiles the same computation (the sampler's sort).
SMALL = dict(max_slots=11, page_size=8, max_model_len=128, num_pages=80, token_buckets=(16, 32))


def _steps(llm: LLM) -> int:
    e = llm.runner
    steps = [getattr(w, n) for w in e.models for n in ("step", "score", "copy")]
    return sum(len(s) for s in steps)


@pytest.fixture(scope="module")
def first(tok_model, tmp_path_factory):
    """One engine of SMALL that compiled every step into a fresh store: the restart test's first
    process, and the store the miss and unreadable-file tests start from (each on a copy)."""
    store = tmp_path_factory.mktemp("store")
    return LLM(tok_model[0], compilation_cache_dir=str(store), **SMALL), store


def _copy_of(first, tmp_path):
    import shutil

    shutil.copytree(first[1], tmp_path / "xla")
    return str(tmp_path / "xla")


def _prompts(n=6, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, vocab, int(rng.integers(2, 40)))] for _ in range(n)]


def test_restart_loads_every_step_without_tracing_and_matches(tok_model, first):
    path, hf = tok_model[:2]
    prompts = _prompts()
    params = [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=12, temperature=0.8, seed=3)]
    first, store_dir = first
    n = _steps(first)
    assert first.runner.store.saved == n > 0 and first.runner.store.loaded == 0
    out1 = [r.token_ids for r in first.generate(prompts, params * 3)]

    second = LLM(path, compilation_cache_dir=str(store_dir), warmup=False, **SMALL)
    traces, compiles = trace_count(), compile_count()
    second.runner.warmup()
    assert trace_count() - traces == 0 and compile_count() - compiles == 0
    store = second.runner.store
    assert (store.loaded, store.saved) == (n, 0)
    assert _steps(second) == n
    out2 = [r.token_ids for r in second.generate(prompts, params * 3)]
    assert out1 == out2
    for p, o in zip(prompts[::2], out2[::2]):  # the greedy ones against transformers alone
        assert o == hf_greedy(hf, p, 12)
    assert compile_count() - compiles == 0


@pytest.mark.parametrize("change", [dict(page_size=16), dict(max_slots=5), dict(dtype="bfloat16")])
def test_a_different_configuration_misses(tok_model, tmp_path, first, change):
    """The steps one short request needs (no warm-up: the first step's lookup is the miss that
    matters, and compiling every bucket three times over tells nothing more) are all compiled."""
    other = LLM(tok_model[0], compilation_cache_dir=_copy_of(first, tmp_path), warmup=False, **{**SMALL, **change})
    other.generate([_prompts(1, seed=2)[0]], SamplingParams(max_tokens=2, **GREEDY))
    assert other.runner.store.loaded == 0 and other.runner.store.saved > 0


def test_unreadable_files_are_skipped_and_the_engine_works(tok_model, tmp_path, first, caplog):
    store_dir = _copy_of(first, tmp_path)
    files = sorted((tmp_path / "xla" / xc.SUBDIR).glob("*.jxe"))
    assert len(files) == first[0].runner.store.saved
    # Within this process the recompiled steps come from jax's in-process cache, and executables
    # handed back by a cache are not written (executable_cache.Step._get): "replaced" is the next
    # process's business; here, unreadable files are skipped with a warning and the engine works.
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    files[1].write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="jaxserve.executable_cache"):
        second = LLM(tok_model[0], compilation_cache_dir=store_dir, **SMALL)
    assert second.runner.store.loaded == len(files) - 2
    assert sum("ignoring unreadable compiled step" in r.message for r in caplog.records) == 2
    prompt = _prompts(1, seed=5)[0]
    assert second.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids == hf_greedy(
        tok_model[1], prompt, 8
    )


def test_names_change_with_context_environment_and_signature(tmp_path, monkeypatch):
    a = xc.ExecutableStore(tmp_path, "engine A")
    assert a.path("decode", "sig") != xc.ExecutableStore(tmp_path, "engine B").path("decode", "sig")
    assert a.path("decode", "sig") != a.path("decode", "sig2") != a.path("prefill", "sig")
    assert a.path("decode", "sig") == xc.ExecutableStore(tmp_path, "engine A").path("decode", "sig")
    before = xc.environment_digest()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert xc.environment_digest() != before
    assert xc.ExecutableStore(tmp_path, "engine A").path("decode", "sig") != a.path("decode", "sig")


def test_describe_distinguishes_shape_dtype_and_structure():
    x = np.zeros((2, 3), np.int32)
    rows = {
        xc.describe((x,)),
        xc.describe((x.astype(np.float32),)),
        xc.describe((np.zeros((3, 2), np.int32),)),
        xc.describe(((x,),)),
        xc.describe((x, None)),
    }
    assert len(rows) == 5


def test_cli_restart_loads_every_step(tmp_path):
    """`jaxserve generate` run twice as fresh processes with one --compilation-cache-dir: the
    first compiles and saves every step, the second loads them all."""
    import os
    import re
    import subprocess
    import sys

    cache = tmp_path / "xla"
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "generate",
        "--model",
        str(TEST_MODEL),
        "--max-tokens",
        "6",
        "--max-slots",
        "8",
        "--gin_param",
        "ServeConfig.token_buckets = (16, 32)",
        "--max-model-len",
        "256",
        "--compilation-cache-dir",
        str(cache),
        "def f():",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSERVE_CACHE_DIR=str(tmp_path / "converted"))
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600) for _ in range(2)]
    counts = []
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        m = re.search(r"(\d+) executables loaded from (\S+), (\d+) compiled and saved", r.stderr)
        assert m, r.stderr[-3000:]
        counts.append((int(m.group(1)), int(m.group(3))))
        assert m.group(2).rstrip(",") == str(cache / xc.SUBDIR)
    n = counts[0][1]
    assert n > 0 and counts == [(0, n), (n, 0)]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("def f():")
    assert len(list((cache / xc.SUBDIR).glob("*.jxe"))) == n
    assert not list(cache.glob("jit_*")), "one process: the store alone, JAX's persistent cache stays off"


def test_a_backend_that_cannot_serialize_still_serves(tok_model, tmp_path, monkeypatch, caplog):
    def refuse(_compiled):
        raise RuntimeError("this backend does not serialize executables")

    monkeypatch.setattr(xc.serialize_executable, "serialize", refuse)
    prompt = _prompts(1, seed=9)[0]
    with caplog.at_level(logging.INFO, logger="jaxserve.executable_cache"):  # compiled as the request needs them
        llm = LLM(tok_model[0], compilation_cache_dir=str(tmp_path / "xla"), warmup=False, **{**SMALL, "max_slots": 7})
        out = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    assert out == hf_greedy(tok_model[1], prompt, 8)
    assert len(llm.runner.target.step) > 0 and llm.runner.store.saved == 0
    assert not list(llm.runner.store.dir.glob("*"))
    assert "cannot be serialized" in caplog.text


def test_warm_up_side_by_side_compiles_what_one_by_one_does(tok_model, tmp_path):
    """compile_ahead: a warm-up on three threads (a draft model's steps defer a level deeper
    than the target's) leaves every step with the executables one thread gives, writes each to
    the store from its thread, and serves the same tokens without another compile."""
    from conftest import make_hf_model

    draft = tmp_path / "draft"
    make_hf_model("llama", draft, seed=7, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    # 77 pages: shapes no other engine in this process compiles, or jax's in-process cache would
    # hand back their executables (not compiled here, so rightly not stored)
    opts = {**SMALL, "max_slots": 3, "num_pages": 77, "token_buckets": (16,), "speculative_model": str(draft)}
    prompts = _prompts(4, seed=4)
    runs = {}
    for workers in (3, 1):  # three first: the other engine's compiles come from jax's own cache
        llm = LLM(tok_model[0], warmup=False, compilation_cache_dir=str(tmp_path / f"xla{workers}"), **opts)
        llm.runner.warmup(workers=workers)
        steps = [s for obj in (llm.runner, *llm.runner.models) for s in vars(obj).values() if isinstance(s, xc.Step)]
        assert not any(s._compiling for s in steps)
        compiled = {s.name: sorted(map(repr, s._compiled)) for s in steps}
        before = compile_count()
        out = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))]
        assert compile_count() == before
        runs[workers] = compiled, out
        if workers == 3:
            n = sum(len(s) for s in steps)
            assert {"target-step", "draft-step", "propose", "verify"} <= compiled.keys() and n > 4
            assert llm.runner.store.saved == n == len(list(llm.runner.store.dir.glob("*.jxe")))
    assert runs[3] == runs[1]


def test_compile_threads_come_from_the_environment(monkeypatch):
    from jaxserve.runner import model_runner

    monkeypatch.setenv("JAXSERVE_COMPILE_THREADS", "3")
    assert model_runner._compile_threads() == 3
    monkeypatch.delenv("JAXSERVE_COMPILE_THREADS")
    assert model_runner._compile_threads() == min(len(os.sched_getaffinity(0)), 8)
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("JAXSERVE_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="JAXSERVE_COMPILE_THREADS"):
            model_runner._compile_threads()


RESTORED = r"""
import sys, jax
root, model, store = sys.argv[1], sys.argv[2], sys.argv[3]
jax.config.update("jax_compilation_cache_dir", root + "/jax-cache")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxserve import LLM, SamplingParams
llm = LLM(model, compilation_cache_dir=root + "/" + store, max_slots=8, page_size=8, max_model_len=128,
          num_pages=80, token_buckets=(16, 32))
out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, temperature=0.7, seed=1))[0].token_ids
print("RESULT", llm.runner.store.loaded, llm.runner.store.saved, out)
"""


def test_executables_restored_from_jax_cache_are_not_stored(tok_model, tmp_path):
    """XLA:CPU re-serializes an executable restored from JAX's persistent cache without all of
    its functions: stored, it loaded fine and failed when run. Only steps compiled in this
    process are written to the store."""
    import os
    import subprocess
    import sys

    def run(store):
        r = subprocess.run(
            [sys.executable, "-c", RESTORED, str(tmp_path), str(tok_model[0]), store],
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
        loaded, saved, out = line.split(" ", 3)[1:]
        return int(loaded), int(saved), out

    first = run("store-a")  # compiles: fills JAX's cache and store-a
    assert first[0] == 0 and first[1] > 0
    assert run("store-b") == (0, 0, first[2])  # every step from JAX's cache (the same tokens): nothing stored
    assert run("store-a") == (first[1], 0, first[2])
