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


@pytest.mark.parametrize("hidden", [576, 512, 100])
def test_rms_norm_is_row_count_invariant(hidden):
    """A row's norm is bit for bit the same alone as among 300 rows (XLA's own reduce summed
    in a shape-dependent order: 93 of 300 rows of width 576 differed in the last bit), and
    within float32 rounding of the float64 norm."""
    from jaxserve.models.llama import RMSNorm

    rng = np.random.default_rng(0)
    norm = RMSNorm(hidden, 1e-5, jnp.float32)
    norm.weight[...] = jnp.asarray(rng.standard_normal(hidden, dtype=np.float32))
    x = rng.standard_normal((300, hidden), dtype=np.float32) * 3
    h = rng.standard_normal((300, hidden), dtype=np.float32)
    f = jax.jit(lambda x, h: norm(x + h))  # the residual add fused in, as in a decoder layer
    alone = np.concatenate([np.asarray(f(x[None, i : i + 1], h[None, i : i + 1]))[0] for i in range(300)])
    for n in (2, 8, 16, 64, 300):
        np.testing.assert_array_equal(np.asarray(f(x[None, :n], h[None, :n]))[0], alone[:n])
    y = (x + h).astype(np.float64)
    want = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5) * np.asarray(norm.weight[...], np.float64)
    np.testing.assert_allclose(alone, want, rtol=2e-6, atol=2e-6)


def test_a_tokens_logits_do_not_depend_on_its_step(tmp_path):
    """The CPU serving path (native matmul panels, native paged attention): the logits and KV
    of four tokens run as one row padded to a 16-token step equal, bit for bit, those of the
    same tokens run one per 1-token step. Speculative verification (a row of k + 1) is then
    exactly plain decoding's arithmetic, so in bfloat16, where a last-bit difference becomes a
    0.4% one at the next matmul's input, greedy output still cannot change (test_speculative)."""
    from conftest import SMOLLM2_WIDTHS, make_hf_model
    from flax import nnx

    from jaxserve.models.linear import pack_native
    from jaxserve.runner import attention
    from pallas_kernels import native, reference
    from pallas_kernels.reference import RaggedMetadata

    assert native.available(), native.unavailable_reason()
    make_hf_model("llama", tmp_path, **SMOLLM2_WIDTHS, initializer_range=0.05)
    model, cfg = load_model(tmp_path, dtype=jnp.float32)
    model.untie_lm_head()
    assert pack_native(model, "float32") > 0
    graphdef, params = nnx.split(model)
    backend = attention.make("native")
    ps, width = 16, 8

    @jax.jit
    def step(params, kv, tokens, md, live):
        m = nnx.merge(graphdef, params)
        n = tokens.shape[0]
        logits, kv = m(
            tokens[None], md.positions[None], kv, md, backend.forward, token_index=jnp.arange(n), num_live_tokens=live
        )
        return logits, kv

    def run(kv, toks, start, bucket):
        t = len(toks)
        pad = lambda a: np.pad(np.asarray(a, np.int32), (0, bucket - t))  # noqa: E731
        pos = np.arange(start, start + t)
        md = RaggedMetadata(
            slot_mapping=jnp.asarray(pad(ps + pos)),  # pages 1, 2, ...; padding writes the dummy page 0
            block_tables=jnp.asarray(np.arange(1, width + 1, dtype=np.int32)[None]),
            seq_lens=jnp.asarray([start + t], jnp.int32),
            query_start_loc=jnp.asarray([0, t], jnp.int32),
            positions=jnp.asarray(pad(pos)),
        )
        logits, kv = step(params, kv, jnp.asarray(pad(toks)), md, jnp.int32(t))
        return np.asarray(logits)[:t], kv

    rng = np.random.default_rng(4)
    context, new = rng.integers(2, cfg.vocab_size, 40).tolist(), rng.integers(2, cfg.vocab_size, 4).tolist()

    def pool():
        layer = lambda: reference.empty_kv_cache(width + 1, ps, cfg.num_kv_heads, cfg.head_dim, jnp.float32)  # noqa: E731
        return tuple(layer() for _ in range(cfg.num_layers))

    kv_row, kv_one = run(pool(), context, 0, 64)[1], run(pool(), context, 0, 64)[1]
    row, kv_row = run(kv_row, new, len(context), 16)
    one = []
    for i, t in enumerate(new):
        logits, kv_one = run(kv_one, [t], len(context) + i, 1)
        one.append(logits[0])
    np.testing.assert_array_equal(row, np.stack(one))
    for a, b in zip(jax.tree.leaves(kv_row), jax.tree.leaves(kv_one)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
