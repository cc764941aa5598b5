"""docs/options.md is what `jaxserve options --markdown` prints from the options' declaration, and
the flags, gin fields and validation all come from that one declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxserve import cli
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.serve_config import DEFAULT_GIN_FILE, ServeConfig, load_config, options_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def test_docs_page_matches_the_declaration(capsys):
    assert cli.main(["options", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == options_markdown()
    assert PAGE.read_text() == printed, "docs/options.md is stale: jaxserve options --markdown > docs/options.md"


def test_every_engine_field_is_documented_and_configurable():
    page = PAGE.read_text()
    for f in dataclasses.fields(EngineConfig):
        assert f"| `{f.name}` |" in page
        assert f.name in {g.name for g in dataclasses.fields(ServeConfig)}
        assert f.metadata["help"], f"{f.name} has no help"
        if f.metadata["cli"]:
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            assert flag in cli.ENGINE_FLAGS or flag in cli.ENGINE_SWITCHES, flag


def test_a_declared_flag_reaches_the_engine_config():
    """Each generated flag sets its field: the value parsed from the command line is the
    EngineConfig's."""
    argv = ["serve", "--max-num-batched-tokens", "128", "--kv-cache-dtype", "int8", "--no-async-scheduling"]
    args = cli.build_parser().parse_args(argv)
    cfg = cli.load_cli_config(args, {**cli.ENGINE_FLAGS, **cli.SERVER_FLAGS}).engine_config()
    assert (cfg.max_num_batched_tokens, cfg.kv_cache_dtype, cfg.async_scheduling) == (128, "int8", False)
    assert cfg == dataclasses.replace(
        load_config([DEFAULT_GIN_FILE]).engine_config(),
        max_num_batched_tokens=128,
        kv_cache_dtype="int8",
        async_scheduling=False,
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of auto, float32, bfloat16, int8, fp8, got 'int4'"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1, got 0"),
        (dict(matmul_impl="cuda"), "matmul_impl must be one of xla, native"),
    ],
)
def test_declared_choices_and_bounds_are_enforced(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_gin_types_are_checked_by_the_declaration():
    with pytest.raises(ValueError, match=r"ServeConfig.memory_fraction must be float, got 'x' \(str\)"):
        load_config([], ["ServeConfig.memory_fraction = 'x'"])
    assert load_config([], ["ServeConfig.token_buckets = [16, 32]"]).token_buckets == (16, 32)
    assert load_config([], ["ServeConfig.memory_fraction = 1"]).memory_fraction == 1.0


def test_attention_impl_choices_are_the_backends_attention_makes():
    """EngineConfig declares the choices without importing jax; attention.IMPLS is what
    attention.make builds: the two lists name the same backends."""
    from jaxserve.runner import attention

    (field,) = [f for f in dataclasses.fields(EngineConfig) if f.name == "attention_impl"]
    assert set(field.metadata["choices"]) == set(attention.IMPLS)
