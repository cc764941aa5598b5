"""The shipped default models (assets/models/default/{target,draft}): they load offline through
jaxserve and transformers, agree with each other, share a tokenizer, and have learned Python."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "models" / "default"
KINDS = ("target", "draft")
PROMPT = "def fibonacci(n):"
N_NEW = 24

SOURCE = '''import os
from collections import defaultdict


class Cache:
    """A tiny least-recently-used cache \u2014 with a non-ASCII docstring: caf\u00e9."""

    def __init__(self, maxsize=128):
        self.maxsize = maxsize
        self._data = {}

    def get(self, key, default=None):
\tif key in self._data:
            value = self._data.pop(key)
            self._data[key] = value
            return value
        return default


def count_words(path):
    counts = defaultdict(int)
    with open(os.path.join(path, "words.txt"), encoding="utf-8") as f:
        for line in f:
            for word in line.split():
                counts[word.lower()] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
'''


def _tokenizer(kind):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / kind))


@pytest.fixture(scope="module")
def tokenizers():
    return {k: _tokenizer(k) for k in KINDS}


@pytest.fixture(scope="module")
def jax_models():
    from jaxserve.models.loader import load_model

    return {k: load_model(ASSETS / k, dtype=jnp.float32, use_cache=False) for k in KINDS}


@pytest.fixture(scope="module")
def hf_models():
    import torch
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(str(ASSETS / k), dtype=torch.float32).eval() for k in KINDS}


def _jax_greedy(model, ids, n, buf=64):
    """Recompute-every-token greedy decoding with jaxserve's dense (no cache) forward. The
    sequence sits right-padded in a fixed [1, buf] buffer, harmless under the causal mask,
    so that one jit compilation serves every step (eager dispatch would recompile per length)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, toks, last):
        logits, _ = nnx.merge(graphdef, state)(toks, jnp.arange(toks.shape[1], dtype=jnp.int32)[None])
        return jnp.argmax(logits[0, last])

    toks = np.zeros((1, buf), np.int32)
    toks[0, : len(ids)] = ids
    for i in range(len(ids), len(ids) + n):
        toks[0, i] = int(next_token(state, jnp.asarray(toks), i - 1))
    return toks[0, len(ids) : len(ids) + n].tolist()


def _hf_greedy(model, ids, n):
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def test_assets_present_and_small():
    total = 0
    for k in KINDS:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (ASSETS / k / name).is_file(), f"{k}/{name} missing"
        weights = list((ASSETS / k).glob("*.safetensors"))
        assert weights, f"{k}: no safetensors"
        assert all(f.stat().st_size < 20 * 1024 * 1024 for f in weights), "keep every file under 20 MB"
        total += sum(f.stat().st_size for f in (ASSETS / k).iterdir() if f.is_file())
    assert total <= 40 * 1024 * 1024, total


def test_configs_and_shared_vocabulary(tokenizers):
    from jaxserve.models.model_config import ModelConfig

    cfgs = {k: ModelConfig.from_dir(ASSETS / k) for k in KINDS}
    raw = {k: json.loads((ASSETS / k / "config.json").read_text()) for k in KINDS}
    assert tokenizers["target"].get_vocab() == tokenizers["draft"].get_vocab()
    assert cfgs["target"].vocab_size == cfgs["draft"].vocab_size == len(tokenizers["target"])
    for k in KINDS:
        tok, cfg = tokenizers[k], cfgs[k]
        assert raw[k]["architectures"] == ["LlamaForCausalLM"]
        assert cfg.architecture == "LlamaForCausalLM" and cfg.rope_type == "default"
        assert cfg.max_position_embeddings == 2048
        assert cfg.bos_token_id == tok.bos_token_id == tok.convert_tokens_to_ids("<s>")
        assert cfg.eos_token_ids == (tok.eos_token_id,) and tok.eos_token == "</s>"
        assert tok.pad_token == "<pad>" and raw[k]["pad_token_id"] == tok.pad_token_id
    assert cfgs["draft"].tie_word_embeddings


def test_tokenizer_round_trip(tokenizers):
    for tok in tokenizers.values():
        ids = tok(SOURCE, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == SOURCE
        assert len(ids) < len(SOURCE.encode()) / 2.5  # BPE merges, not bytes
        with_bos = tok(SOURCE)["input_ids"]
        assert with_bos[0] == tok.bos_token_id and with_bos[1:] == ids
        assert tok.decode(with_bos, skip_special_tokens=True) == SOURCE


def test_parameter_counts(jax_models, hf_models):
    counts = {}
    for k in KINDS:
        model, cfg = jax_models[k]
        _, state = nnx.split(model, nnx.Param)
        counts[k] = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(state))
        assert counts[k] == cfg.num_params() == hf_models[k].num_parameters()
    assert 5_000_000 <= counts["target"] <= 10_000_000
    assert counts["draft"] * 5 <= counts["target"]


@pytest.mark.parametrize("kind", KINDS)
def test_jaxserve_and_transformers_agree(kind, tokenizers, jax_models, hf_models):
    tok = tokenizers[kind]
    ids = tok(PROMPT)["input_ids"]
    assert ids[0] == tok.bos_token_id
    jax_out = _jax_greedy(jax_models[kind][0], ids, N_NEW)
    hf_out = _hf_greedy(hf_models[kind], ids, N_NEW)
    assert jax_out == hf_out, (tok.decode(jax_out), tok.decode(hf_out))


def test_models_learned_python(tokenizers, jax_models):
    """On a snippet neither saw in training: target < draft < uniform, and well below uniform."""
    import optax

    tok = tokenizers["target"]
    ids = jnp.asarray([tok(SOURCE)["input_ids"]], jnp.int32)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    loss = {}
    for k in KINDS:
        logits, _ = jax_models[k][0](ids[:, :-1], pos[:, :-1])
        loss[k] = float(optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean())
    assert loss["target"] < loss["draft"] < math.log(len(tok)) - 3.0, loss
    completion = tok.decode(_jax_greedy(jax_models["target"][0], tok(PROMPT)["input_ids"], N_NEW))
    assert completion.startswith("\n    "), completion  # a function body: newline, then indentation
