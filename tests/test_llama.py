"""The decoder against transformers: logits within 1e-4 and greedy continuations token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.models.loader import load_model

KINDS = ["llama", "mistral", "qwen2"]


def _greedy_dense(model, prompt: list[int], n: int) -> list[int]:
    """Recompute-everything greedy loop: the simplest possible use of the decoder. The row is
    right-padded to a fixed width (invisible under the causal mask) so it compiles once."""
    from flax import nnx

    width = len(prompt) + n
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, row, last):
        logits, _ = nnx.merge(graphdef, state)(row[None], jnp.arange(width)[None], logits_index=last[None])
        return jnp.argmax(logits[0])

    toks = list(prompt)
    for _ in range(n):
        row = jnp.asarray(toks + [0] * (width - len(toks)))
        toks.append(int(next_token(state, row, jnp.asarray(len(toks) - 1))))
    return toks[len(prompt) :]


@pytest.mark.parametrize("kind", KINDS)
def test_last_position_logits_match_transformers(hf_models, kind):
    path, hf = hf_models[kind]
    model, cfg = load_model(path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    lengths = [5, 17, 33]
    prompts = [rng.integers(2, cfg.vocab_size, n) for n in lengths]
    t = max(lengths)
    batch = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p  # right padding: invisible to earlier positions under the causal mask
    logits, _ = model(
        jnp.asarray(batch),
        jnp.broadcast_to(jnp.arange(t), batch.shape),
        logits_index=jnp.asarray([n - 1 for n in lengths]),
    )
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor(p[None])).logits[0, -1].numpy()
        err = np.abs(np.asarray(logits[i]) - ref).max()
        assert err < 1e-4, f"{kind} prompt {i}: max abs error {err}"
        assert ref.max() - np.sort(ref)[-2] > 1e-3  # peaked enough for argmax tests to mean something


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_continuation_matches_generate(hf_models, kind):
    path, hf = hf_models[kind]
    model, cfg = load_model(path, dtype=jnp.float32)
    prompt = [int(x) for x in np.random.default_rng(2).integers(2, cfg.vocab_size, 11)]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert _greedy_dense(model, prompt, 32) == ref


def test_config_reads_rope_scaling_and_biases(hf_models):
    from jaxserve.models.model_config import ModelConfig

    llama = ModelConfig.from_dir(hf_models["llama"][0])
    assert llama.rope_type == "llama3" and llama.rope_theta == 500000.0 and llama.num_kv_heads == 2
    qwen = ModelConfig.from_dir(hf_models["qwen2"][0])
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    hf_inv = hf_models["llama"][1].model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(llama.inv_freq(), hf_inv, rtol=1e-6)


def test_untied_lm_head_and_hidden_states(hf_models):
    """A tied model's untie_lm_head (the runner does it before packing the projections for the
    native CPU matmul) gives the same logits, and return_hidden gives the final-norm hidden
    states the logits are the projection of (an EAGLE head's features)."""
    path, hf = hf_models["qwen2"]
    model, cfg = load_model(path, dtype=jnp.float32)
    assert cfg.tie_word_embeddings
    tokens = jnp.asarray(np.random.default_rng(3).integers(2, cfg.vocab_size, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9), tokens.shape)
    tied, _, hidden = model(tokens, positions, return_hidden=True)
    emb = np.asarray(model.embed_tokens.embedding[...])
    np.testing.assert_allclose(np.asarray(tied), np.asarray(hidden) @ emb.T, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(tokens)), output_hidden_states=True).hidden_states[-1].numpy()
    np.testing.assert_allclose(np.asarray(hidden), ref, atol=1e-4)  # transformers' last entry is after the norm
    model.untie_lm_head()
    assert model.untied and model.lm_head.kernel[...].shape == (cfg.hidden_size, cfg.vocab_size)
    untied, _ = model(tokens, positions)
    np.testing.assert_allclose(np.asarray(untied), np.asarray(tied), rtol=1e-6, atol=1e-6)
