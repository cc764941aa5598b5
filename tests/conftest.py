"""Shared fixtures: seeded random transformers models saved to temporary directories."""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite runs the exact float32 path: on a CPU with AMX or AVX512-BF16 the engine would
# otherwise pack its weights as bfloat16 (matmul_dtype's default), and the equality tests against
# transformers and between paths are float32 tests. Lowering the instruction set turns the
# bfloat16 matmul off in this process and in every server subprocess; the bfloat16 tests
# (test_native_matmul.py) raise it again with native.set_cpu_isa around themselves.
os.environ.setdefault("JAXSERVE_CPU_ISA", "avx512")

# Most of the suite's time is XLA:CPU compiling small models' steps, and LLVM's optimisations are
# most of that: one engine's warm-up compiles in 5.8 s at -O0 against 11.1 s at the default. Tests
# assert on values, never on speed (the benchmarks run at the default level). Subprocesses
# inherit it; those that set XLA_FLAGS themselves start from suite_xla_flags().
# XLA:CPU's MLIR fusion emitters are a third of what is left: with the older emitters a warm-up's
# backend compile takes 4.8 s against 6.6-8.7 s, and the 8-device tensor-parallel script 67 s
# against 136 s (AVX2 host, 2026-12-04). Both emit the same HLO; the tests compare values.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def suite_xla_flags(*extra: str) -> str:
    return " ".join((TEST_XLA_FLAGS, *extra))


if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", "")).strip()

# The rest of that time is the same programs compiled again: most tests build an engine on the
# same small model with the same buckets. One JAX persistent compilation cache serves the whole
# run (both xdist workers, which inherit this environment from the controller, and the servers
# they start): a program compiled once is restored after (test_llm.py alone: 93 s -> 76 s). It
# is new for every run (a clean clone and a second `make test` compile the same), and removed at
# the end. Only programs that took 0.2 s or more to compile are kept: writing every small helper
# (thousands) cost more than it saved. No size cap: a cap turns on JAX's eviction, which locks
# and scans the directory on every read and write (the run was slower than without the cache); an
# entry read while the other worker still writes it fails to load, which JAX treats as a miss.
# Tests of the engine's own executable store turn it off (`no_suite_xla_cache`): the store
# rightly refuses executables restored from JAX's cache (executable_cache.py).
SUITE_XLA_CACHE = "JAXSERVE_TEST_XLA_CACHE"
_MADE_SUITE_XLA_CACHE = SUITE_XLA_CACHE not in os.environ
if _MADE_SUITE_XLA_CACHE:
    os.environ[SUITE_XLA_CACHE] = tempfile.mkdtemp(prefix="jaxserve-test-xla-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[SUITE_XLA_CACHE])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Converted weights (loader.py) go to $JAXSERVE_CACHE_DIR. Each test gets its own (_isolated_cache),
# but module- and session-scoped engines are built before that fixture runs: without this they
# would write to ~/.cache, and both workers, building the same seeded models, into one folder.
# One folder per process, removed when it exits (workers inherit the controller's environment,
# so this is an assignment, not a default).
os.environ["JAXSERVE_CACHE_DIR"] = tempfile.mkdtemp(
    prefix=f"jaxserve-test-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"
)
atexit.register(shutil.rmtree, os.environ["JAXSERVE_CACHE_DIR"], ignore_errors=True)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples in every run (derandomize): a CI run fails on a defect,
# not on the day's draw. `pytest --hypothesis-profile=explore` draws new ones, as while developing.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("ci")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "no_suite_xla_cache: run without the suite's shared JAX compilation cache (in process and in subprocesses)",
    )
    config.addinivalue_line(
        "markers",
        "fast: the module runs in `make test-fast` (pytestmark = pytest.mark.fast): no jitted engine, no "
        "subprocess that builds one; kernels in interpret mode at small sizes. Unmarked modules run in `make test` only.",
    )
    config.pluginmanager.register(FileDurations(config), "jaxserve-file-durations")


# Tiers: `make test` runs every module; `make test-fast` (-m fast) the modules that opt in with
# `pytestmark = pytest.mark.fast`. A new file is in the full suite without anyone editing a list,
# and never slows the fast tier unless its own author marks it (the mark sits beside what makes
# the module fast, where a reviewer sees it).
#
# Order: xdist (`--dist loadfile --no-loadscope-reorder`) hands files to its two workers in
# collection order. A long file started last runs alone on one worker while the other idles, so
# files go out longest first by the seconds each took in the last full run, which the suite
# itself records in tests/durations.json (FileDurations; commit the file when it moves). Files it
# has no figure for (new ones) go first: a long one at the start costs nothing, and what runs
# last is the shortest of the known ones.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_ignore_collect(collection_path, config):
    """With `-m fast`, a test module whose text never names the mark is not even imported:
    collecting (importing) every module would cost the fast tier jax, torch and transformers."""
    if (
        config.option.markexpr == "fast"
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
    ):
        return "pytest.mark.fast" not in collection_path.read_text()
    return None


class FileDurations:
    """Orders the collected tests by tests/durations.json, sums each file's seconds over the run
    (setup, call and teardown; under xdist the controller gets the workers' reports, so a file's
    sum is the time it held its worker) and, after a whole-suite run, writes them back."""

    def __init__(self, config):
        self.config = config
        self.seconds: collections.Counter = collections.Counter()

    @staticmethod
    def recorded() -> dict[str, float]:
        try:
            return json.loads(DURATIONS.read_text())
        except (OSError, ValueError):
            return {}

    def pytest_collection_modifyitems(self, items):
        seconds = self.recorded()
        items.sort(key=lambda item: -seconds.get(item.path.name, math.inf))  # stable: a file's tests keep their order

    def pytest_runtest_logreport(self, report):
        self.seconds[Path(report.location[0]).name] += report.duration

    def whole_suite(self, exitstatus) -> bool:
        """The controller (or the only process) of a run of every file that was not interrupted:
        no file arguments, no -k, -m, --ignore, --deselect or --lf selection; tests passed or failed."""
        c, o = self.config, self.config.option
        selected = o.markexpr or o.keyword or o.ignore or o.ignore_glob or o.deselect or getattr(o, "lf", False)
        return (
            not hasattr(c, "workerinput")
            and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
            and c.args_source is pytest.Config.ArgsSource.TESTPATHS
            and not selected
        )

    def pytest_sessionfinish(self, exitstatus):
        if self.seconds and self.whole_suite(exitstatus):
            ordered = sorted(((f, round(s, 1)) for f, s in self.seconds.items()), key=lambda kv: -kv[1])
            DURATIONS.write_text(json.dumps(dict(ordered), indent=1) + "\n")


def pytest_unconfigure(config):
    if _MADE_SUITE_XLA_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ[SUITE_XLA_CACHE], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _suite_xla_cache_off_where_marked(request):
    """Modules marked `no_suite_xla_cache` (their module-scoped engines included) run with JAX's
    persistent cache off in this process and unset for the subprocesses they start."""
    if request.node.get_closest_marker("no_suite_xla_cache") is None:
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", True)
            compilation_cache.reset_cache()


# The fast test models: jaxserve's small trained Llama (6.5M parameters) and its draft, in the
# checkout. The default model (SmolLM2-135M-Instruct, 30 layers) is for users; tests name these.
TEST_MODEL = Path(__file__).resolve().parents[1] / "assets" / "models" / "default" / "target"
TEST_DRAFT = TEST_MODEL.parent / "draft"


@contextlib.contextmanager
def cpu_isa(name: str):
    """The native kernels at most at instruction set `name` inside the block (yields the one now
    in use), the previous one restored after it."""
    from pallas_kernels import native

    before = native.cpu_isa()
    try:
        yield native.set_cpu_isa(name)
    finally:
        native.set_cpu_isa(before)


def bf16_isas() -> list[str]:
    """The bfloat16 units this host has, slowest first: avx512bf16 (dot products) and, with AMX,
    amx; empty on other hosts (the suite itself runs with them off)."""
    from pallas_kernels import native

    return _isas_up_to_best(native.BF16_ISAS)


def bf16_weight_isas() -> list[str]:
    """Every level at which this host runs bfloat16 weights natively, slowest first: avx2 and
    avx512 (float32 arithmetic), then its bfloat16 units (bf16_isas)."""
    from pallas_kernels import native

    return _isas_up_to_best(native.BF16_WEIGHT_ISAS)


def _isas_up_to_best(isas) -> list[str]:
    from pallas_kernels import native, native_matmul

    best = native.best_cpu_isa() if native_matmul.available() else "unavailable"
    if best not in native.ISAS:
        return []
    return [i for i in isas if native.ISAS.index(i) <= native.ISAS.index(best)]


# SmolLM2-135M's widths (hidden 576, 9 heads of 64, 3 KV heads): where XLA's reduce order once
# made a token's norm depend on its step (llama.mean_square).
SMOLLM2_WIDTHS = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)


def make_hf_model(kind: str, path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """A small random transformers model with peaked outputs (large initializer range) so
    that argmax comparisons mean something; saved with save_pretrained to `path`."""
    import torch
    import transformers as tf

    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        eos_token_id=1,
        bos_token_id=0,
    )
    if kind == "llama":
        base.update(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        )
        cls, cfg_cls = tf.LlamaForCausalLM, tf.LlamaConfig
    elif kind == "mistral":
        base.update(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls, cfg_cls = tf.MistralForCausalLM, tf.MistralConfig
    elif kind == "qwen2":
        base.update(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls, cfg_cls = tf.Qwen2ForCausalLM, tf.Qwen2Config
    elif kind == "qwen3":  # head_dim 32, not hidden / heads (16); tied embeddings as Qwen3-0.6B
        base.update(head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls, cfg_cls = tf.Qwen3ForCausalLM, tf.Qwen3Config
    elif kind == "qwen3_moe":  # 8 experts, top-2, renormalised; layer 1 of 3 a dense MLP among the MoE ones
        base.update(
            head_dim=32,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
        cls, cfg_cls = tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig
    else:
        raise ValueError(kind)
    base.update(overrides)
    torch.manual_seed(seed)
    model = cls(cfg_cls(**base)).eval()
    if kind == "qwen2":  # biases default to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    if kind in ("qwen3", "qwen3_moe"):  # the per-head q/k norms start at one; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.3)
                layer.self_attn.k_norm.weight.normal_(1, 0.3)
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """One saved random model per family: {kind: (dir, torch_model)}."""
    out = {}
    for kind in ("llama", "mistral", "qwen2"):
        d = tmp_path_factory.mktemp(kind)
        out[kind] = (d, make_hf_model(kind, d))
    return out


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "jaxserve-cache"))


def add_tokenizer(path, vocab_size: int = 512):
    """Train a small byte-level BPE tokenizer and save it beside a test model, so text
    prompts, stop strings and detokenization are exercised without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["def f(x):\n    return x + 1\n", "hello world, héllo wörld ☃ 日本語", "the quick brown fox"] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast


@pytest.fixture(scope="session")
def tok_model(tmp_path_factory):
    """A llama test model with a tokenizer: (dir, torch_model, tokenizer)."""
    d = tmp_path_factory.mktemp("llama_tok")
    hf = make_hf_model("llama", d, eos_token_id=1, bos_token_id=0)
    tok = add_tokenizer(d)
    return d, hf, tok


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody is listening on (for a server a test starts by port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_whole(llm, timeout: float = 10.0) -> None:
    """Once the engine (stepped by a server's loop thread) has no request left, every page is
    free or held by the prefix cache: nothing leaked. llm: an LLM, or an engine core with a
    scheduler and a KV manager (EngineCore, FakeEngine).

    Read from another thread while a late request (one a client gave up on while it was still
    being tokenized) may yet arrive and run, so the check is repeated until it holds or the time
    is up: a leak persists, a request passing through does not."""
    import time

    core = getattr(llm, "core", llm)
    scheduler, alloc, prefix_cache = core.scheduler, core.kv.alloc, core.kv.prefix_cache
    deadline = time.monotonic() + timeout
    while True:
        idle = not scheduler.running and not scheduler.waiting
        try:
            cached = set(prefix_cache.pages()) if prefix_cache is not None else set()
        except RuntimeError:  # the engine thread changed the tree while it was read
            cached = None
        if idle and cached is not None and alloc.num_free + len(cached) == alloc.capacity:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert idle, "requests are still running"
    cached = set(prefix_cache.pages()) if prefix_cache is not None else set()
    assert alloc.num_free + len(cached) == alloc.capacity


def tp_models(tmp_path_factory):
    """The two tensor-parallel test models: 8 heads and 8 KV heads (everything divides by 8),
    and one with fewer KV heads (2) than chips. Returns their directories."""
    d = tmp_path_factory.mktemp("tp_model")
    make_hf_model("llama", d, hidden_size=64, num_attention_heads=8, num_key_value_heads=8, intermediate_size=128)
    few = tmp_path_factory.mktemp("tp_few_kv")
    make_hf_model("llama", few, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    return d, few


def run_on_devices(script: str, n_devices: int, *args, timeout: float = 900) -> dict:
    """Run `script` in a subprocess with `n_devices` host devices (the rest of the suite keeps
    one) and return the JSON it prints after "RESULT", digit keys as ints."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    # Without the shared cache: these runs compile for their own device counts (nothing to share),
    # and test_sharding's restart counts the executables its engine stores.
    env = dict(
        os.environ,
        XLA_FLAGS=suite_xla_flags(f"--xla_force_host_platform_device_count={n_devices}"),
        JAX_PLATFORMS="cpu",
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[1],
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    return {(int(k) if k.isdigit() else k): v for k, v in json.loads(line[0][6:]).items()}
