"""Checkpoint loading: shards, the orbax converted-weight cache, and clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_MODEL, make_hf_model
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.models import loader
from jaxserve.models.loader import load_model


def _params(model) -> dict:
    return {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _refuse_checkpoint_reads(monkeypatch) -> None:
    """From here on, a load that reads the checkpoint instead of the converted cache fails the test."""
    monkeypatch.setattr(loader, "_read_checkpoint", lambda *a: pytest.fail("the checkpoint was read again"))


def test_sharded_checkpoint_loads_identically(tmp_path, hf_models):
    single, _ = hf_models["llama"]
    sharded = tmp_path / "sharded"
    make_hf_model("llama", sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = _params(load_model(single)[0]), _params(load_model(sharded)[0])
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_orbax_cache_is_used_identical_and_rebuilt_when_corrupt(tmp_path, caplog, monkeypatch):
    # A model whose conversion costs real time (~60 MB of float32 weights to transpose and copy).
    path = tmp_path / "m"
    make_hf_model(
        "llama",
        path,
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    m1, _ = load_model(path, cache_dir=cache)
    cold = time.perf_counter() - t0
    # The second load reads the cache, not the checkpoint (which is what makes it faster; the
    # time is printed, not asserted: this machine is noisy).
    with monkeypatch.context() as m:
        _refuse_checkpoint_reads(m)
        t0 = time.perf_counter()
        m2, _ = load_model(path, cache_dir=cache)
        warm = time.perf_counter() - t0
    print(f"first load (convert + save cache) {cold:.3f}s, second load (from orbax cache) {warm:.3f}s")
    p1, p2 = _params(m1), _params(m2)
    for k in p1:
        np.testing.assert_array_equal(p1[k], p2[k], err_msg=k)

    # Corrupt: flip the stored checksums' view of the data by rewriting one array file's bytes.
    meta = json.loads((cache / "jaxserve_meta.json").read_text())
    meta["checksums"][next(iter(meta["checksums"]))] += 1.0
    (cache / "jaxserve_meta.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="jaxserve.loader"):
        m3, _ = load_model(path, cache_dir=cache)
    assert "corrupt" in caplog.text
    for k, v in _params(m3).items():
        np.testing.assert_array_equal(v, p1[k], err_msg=k)

    # Truncated array data: unreadable, rebuilt.
    caplog.clear()
    for f in (cache / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 4096:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    with caplog.at_level("WARNING", logger="jaxserve.loader"):
        m4, _ = load_model(path, cache_dir=cache)
    assert "rebuilding" in caplog.text
    for k, v in _params(m4).items():
        np.testing.assert_array_equal(v, p1[k], err_msg=k)


def test_cache_of_other_weights_is_not_used(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_hf_model("llama", a, seed=0)
    make_hf_model("llama", b, seed=1)
    cache = tmp_path / "cache"
    load_model(a, cache_dir=cache)
    pb, _ = load_model(b, cache_dir=cache)  # same cache dir, other weights: must rebuild
    ref, _ = load_model(b, use_cache=False)
    for k, v in _params(pb).items():
        np.testing.assert_array_equal(v, _params(ref)[k], err_msg=k)


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not implemented"):
        load_model(tmp_path)


def test_missing_tensor_named(tmp_path, hf_models):
    src, _ = hf_models["llama"]
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_model(dst, use_cache=False)


def test_wrong_shape_named(tmp_path, hf_models):
    src, _ = hf_models["llama"]
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight.*shape \(3, 64\).*expected \(32, 64\)"):
        load_model(dst, use_cache=False)


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_bfloat16_weights_cast_to_compute_dtype(tmp_path):
    import torch

    path = tmp_path / "bf16"
    hf = make_hf_model("llama", path)
    hf.to(torch.bfloat16).save_pretrained(path)
    model, _ = load_model(path, dtype=jnp.float32, use_cache=False)
    emb = np.asarray(model.embed_tokens.embedding.get_value())
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(emb, hf.model.embed_tokens.weight.float().detach().numpy())


def test_random_init_dir_makes_the_familys_own_weights_in_dtype(tmp_path):
    """A config.json with loader.RANDOM_INIT and no weights: load_model makes, in one jit and in
    bfloat16 from the start, exactly the weights the family's own initializers make eagerly with
    that seed (the oracle), unit norms included; nothing is cached; quantization is refused."""
    from jaxserve.models import registry

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
    path = loader.write_random_init(tmp_path / "random", config, seed=3, std=0.05)
    model, cfg = load_model(path, dtype=jnp.bfloat16, cache_dir=tmp_path / "cache")
    want = registry.family(cfg.architecture).model(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3), init_std=0.05)
    got, ref = _params(model), _params(want)
    assert sorted(got) == sorted(ref) and len(got) == 2 + 2 * 9 + 1  # embed, head, norm; 9 per layer
    for name, w in got.items():
        assert w.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(w.astype(np.float32), ref[name].astype(np.float32), err_msg=name)
    assert float(np.std(got[str(("embed_tokens", "embedding"))].astype(np.float32))) == pytest.approx(0.05, rel=0.1)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="quantization is not supported"):
        load_model(path, quantization="int8")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_config_from_the_converted_cache_equals_transformers(kind, hf_models, tmp_path):
    from jaxserve.models.model_config import ModelConfig

    path = hf_models[kind][0]
    _, cold = load_model(path, cache_dir=tmp_path / "cache")
    _, warm = load_model(path, cache_dir=tmp_path / "cache")
    assert cold == warm == ModelConfig.from_dir(path)
    assert ModelConfig.from_json(json.loads((tmp_path / "cache" / "jaxserve_meta.json").read_text())["config"]) == cold


def test_changed_config_json_is_not_taken_from_the_cache(tmp_path):
    path = tmp_path / "m"
    make_hf_model("llama", path)
    cache = tmp_path / "cache"
    _, before = load_model(path, cache_dir=cache)
    raw = json.loads((path / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(raw))
    _, after = load_model(path, cache_dir=cache)
    assert after.rms_norm_eps == 1e-3 and before.rms_norm_eps == 1e-5


def test_warm_start_imports_neither_torch_nor_transformers_auto_classes(tmp_path):
    """A restart reads the model config from the converted-weight cache and loads a generic
    fast tokenizer directly: transformers' auto classes import torch where it is installed
    (about 1.5 s of every start). torch is installed here (the test oracle), so this can fail."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from jaxserve.engine.tokenizer import load_tokenizer; "
        "from jaxserve.models.loader import load_model; load_model(sys.argv[1]); load_tokenizer(Path(sys.argv[1])); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('transformers.models.auto')))"
    )
    env = dict(os.environ, JAXSERVE_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    run = lambda: (
        subprocess.run(
            [sys.executable, "-c", code, str(TEST_MODEL)],
            env=env,
            capture_output=True,
            text=True,  # noqa: E731
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert "transformers.models.auto.configuration_auto" in run()  # cold: transformers parses config.json
    assert run() == "[]"


def test_two_loads_converting_at_once_leave_one_whole_cache(tmp_path, hf_models, monkeypatch):
    """Two servers started together convert the same checkpoint at once: each process writes
    beside the cache and renames its copy into place, so one whole copy stays (no temporary
    folder is left) and the next load reads it, not the checkpoint. (Processes, not threads:
    orbax's checkpointer is not safe for two saves at once in one process.)"""
    path, _ = hf_models["llama"]
    cache = tmp_path / "converted" / "m"
    code = "import sys; from jaxserve.models.loader import load_model; load_model(sys.argv[1], cache_dir=sys.argv[2])"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), str(cache)], env=env, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    assert [p.name for p in cache.parent.iterdir()] == ["m"]
    fresh = _params(load_model(path, use_cache=False)[0])
    _refuse_checkpoint_reads(monkeypatch)
    again = _params(load_model(path, cache_dir=cache)[0])
    assert again.keys() == fresh.keys()
    for k in again:
        np.testing.assert_array_equal(again[k], fresh[k], err_msg=k)
