"""Gemma 3 (text): the Llama decoder with sliding-window layers, four norms per block and a
GELU MLP, as transformers' `Gemma3ForCausalLM` computes it.

Where it differs from Llama:

* attention: five sliding-window layers to one global (transformers' `layer_types`; the 270M's
  window is 512 keys), each kind with its own RoPE base (10k local, 1M global, the global one
  possibly linearly scaled); an RMSNorm over each head of q and k before RoPE (as Qwen3); the
  scale `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
* norms: `x * (1 + w)` in float32 with the weight stored zero-centred, four per block
  (input, post-attention, pre- and post-feed-forward: each sublayer's output is normalised
  before it joins the residual) and one at the end;
* the embeddings are multiplied by sqrt(hidden) (rounded to the model's dtype, as transformers'
  buffer is); the vocabulary projection is the tied, unscaled embedding;
* MLP: GELU (tanh approximation) gated, `down(gelu(gate(x)) * up(x))`.

No soft-capping (Gemma 3 dropped Gemma 2's; a config that sets it is refused) and no
bidirectional attention (EmbeddingGemma's; refused too). The sliding window is masked by every
attention backend (`window` of the attention call); the local layers' KV lives in a page pool
of its own, whose pages that fell out of the window the KV manager frees (engine/kv_manager.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import llama
from jaxserve.models.contract import Family, Getter
from jaxserve.models.model_config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nnx.Module):
    """RMSNorm scaling by 1 + w (w stored zero-centred), all in float32, then cast back
    (Gemma3RMSNorm: Llama's multiplies after the cast)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(llama.mean_square(x32) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3Attention(llama.Attention):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        super().__init__(cfg, dtype, rngs, std)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def normalize_qk(self, q, k):
        """Each head of q [B, T, N, D] and k [B, T, KVH, D] normalised over its D values."""
        return self.q_norm(q), self.k_norm(k)


class Gemma3MLP(llama.MLP):
    def activation(self, gate):
        """transformers' `gelu_pytorch_tanh`."""
        return jax.nn.gelu(gate, approximate=True)


class Gemma3DecoderLayer(nnx.Module):
    """Norm, attention, norm, residual; norm, MLP, norm, residual. Its attention kind (window
    and RoPE tables) is the config's for this layer."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float, attention, mlp, layer: int = 0):
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = attention(cfg, dtype, rngs, std)
        self.self_attn.window = cfg.layer_window(layer)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp(cfg, dtype, rngs, std)
        self.post_feedforward_layernorm = norm()
        self.rope_kind = "local" if cfg.is_sliding(layer) else "global"

    def __call__(self, x, rope_cs, cache, meta, attn_fn):
        h, cache = self.self_attn(self.input_layernorm(x), rope_cs[self.rope_kind], cache, meta, attn_fn)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h), cache


class Gemma3ForCausalLM(llama.LlamaForCausalLM):
    """A `contract.CausalLM`; parameter names mirror transformers' `Gemma3ForCausalLM`."""

    attention = Gemma3Attention
    decoder_layer = Gemma3DecoderLayer

    def make_mlp(self, layer: int):
        return Gemma3MLP

    def make_norm(self, dim: int) -> nnx.Module:
        return GemmaRMSNorm(dim, self.cfg.rms_norm_eps, self.dtype)

    def embed(self, tokens) -> jax.Array:
        """Embeddings times sqrt(hidden), the factor rounded to the table's dtype first."""
        x = self.embed_tokens(tokens)
        return x * jnp.asarray(np.sqrt(self.cfg.hidden_size), x.dtype)

    def rope(self, positions, dtype) -> dict:
        """The global layers' tables and the local layers' (their own base): each layer picks its
        kind's (a model without sliding layers computes only the global ones)."""
        tables = {"global": llama.rope_tables(positions, jnp.asarray(self.cfg.inv_freq()), dtype)}
        if any(self.cfg.is_sliding(i) for i in range(self.cfg.num_layers)):
            tables["local"] = llama.rope_tables(positions, jnp.asarray(self.cfg.inv_freq(local=True)), dtype)
        return tables


def _rope_fields(get: Getter) -> dict:
    """rope_theta, rope_scaling and rope_local_theta from transformers 5's per-kind
    `rope_parameters` ({"full_attention": {...}, "sliding_attention": {...}}) or an older
    config.json's `rope_theta`, `rope_local_base_freq` and `rope_scaling`."""
    params = dict(get("rope_parameters") or {})
    full = dict(params.get(FULL) or get("rope_scaling") or {})
    local = dict(params.get(SLIDING) or {})
    theta = float(full.pop("rope_theta", get("rope_theta", None) or 1_000_000.0))
    local_theta = float(local.pop("rope_theta", get("rope_local_base_freq", None) or 10_000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3: sliding layers' rope_type {local['rope_type']!r} is not supported (default only)")
    full.pop("type", None)
    if full.get("rope_type", "default") == "default":
        full = {}
    return dict(rope_theta=theta, rope_scaling=tuple(sorted(full.items())), rope_local_theta=local_theta)


def _layer_types(get: Getter, layers: int) -> tuple[str, ...]:
    """transformers' `layer_types`, else its default: every `sliding_window_pattern`-th layer
    (6: five local to one global) full."""
    types = get("layer_types")
    if types:
        return tuple(types)
    pattern = int(get("sliding_window_pattern", None) or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))


def config(get: Getter) -> dict:
    """config.json -> the fields Gemma 3 sets beyond the shared ones; ValueError for what it
    does not compute (soft-capping, bidirectional attention, another activation)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(key, None):
            raise ValueError(f"gemma3: {key}={get(key)} is not supported (Gemma 3 has none)")
    if get("use_bidirectional_attention", None):
        raise ValueError("gemma3: use_bidirectional_attention=True is not supported (causal only)")
    act = get("hidden_activation", None) or get("hidden_act", None) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    window = get("sliding_window", None)
    return dict(
        qk_norm=True,
        block_norms=4,
        qkv_bias=False,
        o_bias=False,
        sliding_window=int(window) if window else None,
        layer_types=_layer_types(get, int(get("num_hidden_layers"))),
        query_pre_attn_scalar=float(get("query_pre_attn_scalar", None) or 256),
        **_rope_fields(get),
    )


def gguf_config(get: Getter) -> dict:
    """A llama.cpp `gemma3` GGUF's metadata -> Gemma 3's fields, as llama.cpp and transformers'
    GGUF reader take them: the window from `attention.sliding_window`, every sixth layer global,
    local RoPE base 10k (llama.cpp's constant), global `rope.freq_base` with `rope.scaling.factor`
    as linear scaling, and the attention scale of the head width (`attention.key_length`: the
    query_pre_attn_scalar of every Gemma 3 but the 27B, which llama.cpp scales by hidden/heads)."""
    window = get("attention.sliding_window")
    layers = int(get("block_count"))
    factor = get("rope.scaling.factor")
    return dict(
        qk_norm=True,
        block_norms=4,
        sliding_window=int(window) if window else None,
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(layers)),
        rope_local_theta=10_000.0,
        rope_scaling=(("factor", float(factor)), ("rope_type", "linear")) if factor and factor != 1 else (),
        query_pre_attn_scalar=float(get("attention.key_length")),
    )


def gguf_norm_value(name: str, arr):
    """llama.cpp stores Gemma's norm weights with the +1 folded in; the layers add it back."""
    return arr - 1.0 if name.endswith("norm.weight") else arr


# Gemma's turn format, for checkpoints without a template (the 270M GGUF has none): a system
# message opens the first user turn, the assistant's role is "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] ~ '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ((prefix if loop.first else '') ~ m['content']) | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

GEMMA3 = Family(
    model=Gemma3ForCausalLM,
    tp_layout=llama.TP_LAYOUT,
    hf_config=config,
    gguf_config=gguf_config,
    gguf_tensors={
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    gguf_tensor_value=gguf_norm_value,
    chat_template=CHAT_TEMPLATE,
)
