"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k before RoPE.

Where it differs from Llama, as transformers' `Qwen3Attention` computes it: `q_norm` and
`k_norm` (weights [head_dim], shared by the heads) normalise every query and key head on its
own, after the projection and before the rotation; `head_dim` is the config's own (Qwen3-0.6B:
128 with hidden 1024 and 16 heads), not hidden / heads; no q/k/v bias. Everything else is
Llama's (models/llama.py): RoPE, grouped-query attention, SwiGLU, tied or untied embeddings.

The whole family is this module plus its line in `registry.FAMILIES`: the layers below, the
config fields it sets (`qk_norm`), its GGUF tensor names (llama.cpp's `attn_q_norm` and
`attn_k_norm`; its converter does not permute a Qwen GGUF's Q/K rows) and its tensor-parallel
layout (Llama's: the norms act within a head, so they are replicated while heads split).
"""

from __future__ import annotations

from flax import nnx

from jaxserve.models import llama
from jaxserve.models.contract import Family, Getter
from jaxserve.models.model_config import ModelConfig


class Qwen3Attention(llama.Attention):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        super().__init__(cfg, dtype, rngs, std)
        self.q_norm = llama.RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = llama.RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def normalize_qk(self, q, k):
        """Each head of q [B, T, N, D] and k [B, T, KVH, D] normalised over its D values."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(llama.LlamaForCausalLM):
    attention = Qwen3Attention


def config(get: Getter) -> dict:
    """config.json or GGUF metadata -> the field Qwen3 adds (its `head_dim` is read by the shared
    parser: config.json's `head_dim`, a GGUF's `qwen3.attention.key_length`)."""
    return {"qk_norm": True}


QWEN3 = Family(
    model=Qwen3ForCausalLM,
    tp_layout=llama.TP_LAYOUT,
    hf_config=config,
    gguf_config=config,
    gguf_tensors={"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
)
