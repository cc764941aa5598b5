"""The model registry: every family line loads to a `Family` whose decoder keeps the model
contract, unsupported architectures are refused by name, and a family another package
registers through the `jaxserve.models` entry point group is served like jaxserve's own (a
real distribution on sys.path, found by importlib.metadata, loaded end to end)."""

from __future__ import annotations

import json
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model
from flax import nnx

from jaxserve.models import contract, registry
from jaxserve.models.loader import load_model
from jaxserve.models.model_config import ModelConfig


def test_every_family_loads_and_its_decoder_keeps_the_contract():
    for entry in registry.FAMILIES:
        fam = registry._load(entry.family)
        assert isinstance(fam, contract.Family)
        for method in ("__call__", "untie_lm_head", "input_embedding"):
            assert callable(getattr(fam.model, method, None)), (entry, method)
        assert registry.model_class(entry.hf_architectures[0]) is fam.model
        for gguf_arch in entry.gguf_architectures:
            assert registry.find_gguf(gguf_arch) == (entry.hf_architectures[0], entry)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        registry.supported()
    )


def test_a_model_keeps_the_contract(hf_models):
    model, cfg = load_model(hf_models["qwen2"][0], dtype=jnp.float32)
    assert isinstance(model, contract.CausalLM)
    np.testing.assert_array_equal(
        np.asarray(model.input_embedding()), hf_models["qwen2"][1].model.embed_tokens.weight.detach().numpy()
    )


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'\].*Qwen3ForCausalLM"):
        ModelConfig.check_dir(tmp_path)
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        registry.family("GPT2LMHeadModel")


PLUGIN = textwrap.dedent('''
    """A family from another package: Llama's layers with a bias on every MLP projection."""
    from jaxserve.models import llama
    from jaxserve.models.contract import Family
    from jaxserve.models.registry import Entry

    ENTRY = Entry(("ToyForCausalLM",), ("toy",), (), "jaxserve_toy:TOY")
    TOY = Family(model=llama.LlamaForCausalLM, tp_layout=llama.TP_LAYOUT, hf_config=lambda get: {"mlp_bias": True})
    NOT_AN_ENTRY = 42
''')


def _install(site, target: str) -> None:
    (site / "jaxserve_toy.py").write_text(PLUGIN)
    dist = site / "jaxserve_toy-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxserve-toy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[jaxserve.models]\ntoy = {target}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for a distribution, the registry's entry-point cache cleared around the test."""
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    registry.entries.cache_clear()
    yield d
    monkeypatch.undo()
    registry.entries.cache_clear()


def test_an_entry_point_family_is_served(site, tmp_path):
    """A Llama checkpoint renamed ToyForCausalLM, with MLP biases: the plug-in's family maps the
    config, the loader reads the biases, and the logits are transformers'."""
    _install(site, "jaxserve_toy:ENTRY")
    path = tmp_path / "toy"
    hf = make_hf_model("llama", path, mlp_bias=True)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.down_proj.bias.normal_(0, 0.3)
    hf.save_pretrained(str(path))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["ToyForCausalLM"]}))
    assert "ToyForCausalLM" in registry.supported()
    model, cfg = load_model(path, dtype=jnp.float32, use_cache=False)
    assert cfg.architecture == "ToyForCausalLM" and cfg.mlp_bias
    tokens = np.random.default_rng(0).integers(2, cfg.vocab_size, (1, 12))
    logits, _ = model(jnp.asarray(tokens), jnp.arange(12)[None])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    assert np.abs(np.asarray(logits) - ref).max() < 1e-4
    assert isinstance(nnx.state(model), nnx.State)


def test_a_broken_entry_point_is_named(site):
    _install(site, "jaxserve_toy:NOT_AN_ENTRY")
    with pytest.raises(ValueError, match=r"entry point 'toy' \(jaxserve_toy:NOT_AN_ENTRY\) must load to"):
        registry.supported()
