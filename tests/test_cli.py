"""The jaxserve command in-process: help, usage errors (exit 2), gin flags and their precedence,
the effective-configuration log, kv-math through the CLI. No model is loaded here."""

from __future__ import annotations

import json
import logging

import pytest

from jaxserve import cli
from jaxserve import kv_math as km
from jaxserve.serve_config import DEFAULT_GIN_FILE, load_config

pytestmark = pytest.mark.fast

COMMANDS = ["serve", "generate", "client", "kv-math", "bench", "convert"]


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse exits on --help and on usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_on_each_subcommand(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    assert "usage:" in out
    assert "--gin_file" in out and "--gin_param" in out


def test_top_level_help_and_no_command(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and all(c in out for c in COMMANDS)
    code, _, err = run([], capsys)
    assert code == 2 and "usage:" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--no-such-flag"], "jaxserve serve: error: unrecognized arguments: --no-such-flag"),
        (["serve", "--max-slots", "many"], "jaxserve serve: error: argument --max-slots: invalid int value: 'many'"),
        (["generate"], "jaxserve generate: error: the following arguments are required: prompt"),
        (["serve", "--token-buckets", "16,x"], "expected comma-separated integers"),
        (["frobnicate"], "jaxserve: error: argument COMMAND: invalid choice: 'frobnicate'"),
        (["bench"], "usage: jaxserve bench [-h] SUBCOMMAND"),
        (["bench", "nosuch"], "jaxserve bench: error: argument SUBCOMMAND: invalid choice: 'nosuch'"),
        (["bench", "serve"], "jaxserve bench serve: error: the following arguments are required: --base-url"),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["serve", "--gin_param", "ServeConfig.max_slotz = 2"],
            "jaxserve serve: error: gin binding 'ServeConfig.max_slotz = 2'",
        ),
        (
            ["generate", "--gin_param", "Server.port = 1", "hi"],
            "jaxserve generate: error: gin binding 'Server.port = 1'",
        ),
        (["serve", "--gin_file", "nope.gin"], "jaxserve serve: error: gin file 'nope.gin' not found"),
        (["serve", "--max-slots", "0"], "jaxserve serve: error: ServeConfig.max_slots = 0: max_slots must be >= 1"),
        (["serve", "--attention-impl", "cuda"], "ServeConfig.attention_impl = 'cuda'"),
        (
            ["client", "--gin_param", "ServeConfig.port = -1", "hi"],
            "jaxserve client: error: ServeConfig.port must be in",
        ),
        (["convert", "--gin_param", "ServeConfig.dtype = 3"], "jaxserve convert: error: ServeConfig.dtype must be"),
        (["kv-math", "--gin_param", "ServeConfig.page_size = 0"], "jaxserve kv-math: error: ServeConfig.page_size = 0"),
        (
            ["serve", "--gin_param", "import no_such_module"],
            "jaxserve serve: error: gin binding 'import no_such_module': No module named 'no_such_module'",
        ),
        (["generate", "--dtype", "foo", "hi"], "jaxserve generate: error: ServeConfig.dtype = 'foo': dtype must be"),
        (
            ["bench", "throughput", "--gin_param", "ServeConfig.bogus = 1"],
            "jaxserve bench throughput: error: gin binding",
        ),
    ],
)
def test_bad_gin_and_bad_values_exit_2_before_loading_anything(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err


def _cfg(argv: list[str], flags=None):
    args = cli.build_parser().parse_args(argv)
    return cli.load_cli_config(args, flags if flags is not None else {**cli.ENGINE_FLAGS, **cli.SERVER_FLAGS})


def test_precedence_defaults_files_params_flags():
    assert _cfg(["serve"]) == load_config([DEFAULT_GIN_FILE])  # no --gin_file: configs/default.gin
    cfg = _cfg(
        [
            "serve",
            "--gin_file",
            "llama-3.1-8b-instruct.gin",
            "--gin_param",
            "ServeConfig.max_slots = 8",
            "--gin_param",
            "ServeConfig.port = 7000",
            "--max-slots",
            "4",
            "--no-prefix-caching",
            "--token-buckets",
            "16,64",
            "--tensor-parallel-size",
            "2",
            "--model",
            "/data/m",
        ]
    )
    assert (cfg.max_slots, cfg.port, cfg.enable_prefix_caching) == (4, 7000, False)
    assert cfg.token_buckets == (16, 64) and cfg.tensor_parallel_size == 2 and cfg.model == "/data/m"
    assert cfg.dtype == "bfloat16" and cfg.metrics_port == 9090  # untouched gin values stay
    assert _cfg(["serve", "--no-compilation-cache"]).compilation_cache_dir is None
    assert _cfg(["serve", "--compilation-cache-dir", "/tmp/xla"]).compilation_cache_dir == "/tmp/xla"
    # the old flags keep working
    cfg = _cfg(
        [
            "serve",
            "--port",
            "0",
            "--grace",
            "0.5",
            "--max-slots",
            "2",
            "--page-size",
            "8",
            "--max-model-len",
            "160",
            "--num-pages",
            "64",
        ]
    )
    assert (cfg.port, cfg.grace, cfg.max_slots, cfg.page_size, cfg.max_model_len, cfg.num_pages) == (
        0,
        0.5,
        2,
        8,
        160,
        64,
    )
    assert cfg.server_options()["grace_s"] == 0.5


def test_the_effective_configuration_is_logged_at_start(caplog, capsys, tmp_path):
    caplog.set_level(logging.INFO, logger="jaxserve.cli")
    code, _, err = run(
        [
            "generate",
            "--model",
            str(tmp_path / "missing"),
            "--max-slots",
            "3",
            "--gin_param",
            "ServeConfig.page_size = 8",
            "--no-compilation-cache",
            "hi",
        ],
        capsys,
    )
    assert code == 2 and "jaxserve generate: error:" in err  # the checkpoint does not exist
    text = caplog.text
    assert "effective configuration" in text and "default.gin" in text
    assert "ServeConfig.max_slots = 3" in text and "ServeConfig.page_size = 8" in text
    assert "flags: max_slots=3" in text


def test_enable_compilation_cache_sets_jax_options(tmp_path):
    import jax

    before = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
        jax.config.jax_persistent_cache_min_entry_size_bytes,
    )
    try:
        assert cli.enable_compilation_cache(None) is None
        path = cli.enable_compilation_cache(str(tmp_path / "xla"))
        assert path == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
        assert jax.config.jax_compilation_cache_dir == path
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    finally:
        for name, value in zip(
            (
                "jax_compilation_cache_dir",
                "jax_persistent_cache_min_compile_time_secs",
                "jax_persistent_cache_min_entry_size_bytes",
            ),
            before,
        ):
            jax.config.update(name, value)


def test_kv_math_through_the_cli(capsys):
    code, out, _ = run(["kv-math", "--model", "llama-3-8b", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["model"] == "llama-3-8b" and plan["max_concurrent_requests"] > 0


def test_kv_math_sizes_a_gin_deployment(capsys):
    code, out, _ = run(["kv-math", "--gin_file", "llama-3.1-70b-instruct.gin", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert (plan["model"], plan["num_chips"], plan["context_len"]) == ("llama-3.1-70b", 8, 8192)
    code, out, _ = run(["kv-math", "--gin_file", "llama-3.1-70b-instruct.gin", "--chips", "4", "--json"], capsys)
    assert json.loads(out)["num_chips"] == 4  # an explicit flag beats gin
    gin = ["kv-math", "--gin_file", "llama-3.1-70b-instruct.gin", "--json"]
    plans = {}
    for q in ("None", "'int8'"):
        quant = ["--gin_param", f"ServeConfig.quantization = {q}", "--gin_param", "ServeConfig.kv_cache_dtype = 'int8'"]
        code, out, _ = run(gin + quant, capsys)
        assert code == 0
        plans[q] = json.loads(out)
    # the deployment's int8 KV cache and int8 weights reach the plan: kv-math's own bytes per token
    want = km.kv_bytes_per_token(km.PRESETS["llama-3.1-70b"], kv_dtype="int8")
    assert plans["None"]["kv_dtype"] == "int8" and plans["None"]["kv_bytes_per_token"] == want
    assert (plans["None"]["weight_dtype"], plans["'int8'"]["weight_dtype"]) == ("bf16", "int8")
    assert plans["'int8'"]["weight_bytes_total"] < 0.6 * plans["None"]["weight_bytes_total"]


def test_client_target_from_gin():
    assert cli._client_target("0.0.0.0", 9000) == "127.0.0.1:9000"
    assert cli._client_target("10.1.2.3", 50051) == "10.1.2.3:50051"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--token-file", "/nope/token"], "jaxserve serve: error: --token-file: cannot read '/nope/token'"),
        (["--tls-cert", "/nope/c.pem", "--tls-key", "/nope/k.pem"], "jaxserve serve: error: --tls-cert: cannot read"),
    ],
)
def test_serve_reads_its_files_before_loading_the_model(argv, message, capsys, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the files were read")

    monkeypatch.setattr(cli, "_build_llm", no_model)
    code, _, err = run(["serve", "--port", "0", *argv], capsys)
    assert code == 2 and message in err


def test_kv_math_takes_the_default_gguf_model(capsys):
    from jaxserve.models.registry import default_model

    if not str(load_config([DEFAULT_GIN_FILE]).model_path).endswith(".gguf") or not default_model().is_file():
        pytest.skip("the default model is not an installed GGUF file")
    code, out, err = run(["kv-math", "--gin_file", "default.gin", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)
