"""Qwen3-MoE: Qwen3's attention with a routed mixture of experts in place of most MLPs.

As transformers' `Qwen3MoeSparseMoeBlock` computes it: the router's logits (`mlp.gate`, [E, H],
no bias) go through a float32 softmax, each token keeps its `num_experts_per_tok` most likely
experts, and with `norm_topk_prob` those k weights are renormalised to sum to one; each chosen
expert is a SwiGLU MLP of width `moe_intermediate_size`, and the token's output is the
weighted sum of its experts' outputs. A layer is sparse unless it is in `mlp_only_layers` or
`(layer + 1) % decoder_sparse_step != 0`; those keep a dense MLP of `intermediate_size`.

The experts run as one grouped matmul: the (token, expert) pairs are sorted by expert and
`jax.lax.ragged_dot` multiplies each expert's contiguous rows by that expert's weights (the
experts' weights are stacked [E, in, out]), so a step is three products whatever the routing,
with fixed shapes (N tokens x k pairs). Each token's k outputs are then summed in its own
order, so a token's result does not depend on what else is in its step.

A checkpoint stores one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...);
`checkpoint_tensor` names them so the loader stacks them. Under tensor parallelism the experts
and the router are replicated (expert parallelism is not built yet); attention and the dense
layers split as Llama's do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.kv_math import sparse_layers
from jaxserve.models import llama, qwen3
from jaxserve.models.contract import CheckpointTensor, Family, Getter, mirrored_name
from jaxserve.models.model_config import ModelConfig

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        self.weight = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (cfg.num_experts, cfg.hidden_size), dtype))

    def __call__(self, x):
        """x [N, H] -> router logits [N, E] in float32 (the softmax's precision)."""
        return jnp.dot(x, self.weight[...].T).astype(jnp.float32)


class Experts(nnx.Module):
    """E SwiGLU MLPs, their weights stacked [E, in, out]."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.normal(std)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), dtype))

    def __call__(self, x, group_sizes):
        """x [M, H]: rows sorted by expert, group_sizes [E] how many rows each expert has."""
        gate = jax.lax.ragged_dot(x, self.gate_proj[...], group_sizes)
        up = jax.lax.ragged_dot(x, self.up_proj[...], group_sizes)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.down_proj[...], group_sizes)


class SparseMoe(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        self.gate = Router(cfg, dtype, rngs, std)
        self.experts = Experts(cfg, dtype, rngs, std)
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob

    def __call__(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        n, k = h.shape[0], self.top_k
        probs = jax.nn.softmax(self.gate(h), axis=-1)
        weights, chosen = jax.lax.top_k(probs, k)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)
        flat = chosen.reshape(-1)  # pair i = (token i // k, its (i % k)-th expert)
        order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        out = self.experts(h[order // k], group_sizes)
        per_pair = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)  # back in token order
        return jnp.sum(per_pair * weights[..., None], axis=1).reshape(shape)


class Qwen3MoeForCausalLM(qwen3.Qwen3ForCausalLM):
    def make_mlp(self, layer: int):
        return SparseMoe if layer in self.cfg.sparse_layers else llama.MLP


def _moe_fields(num_layers: int, num_experts, top_k, width, norm_topk_prob, mlp_only_layers, step) -> dict:
    for key, value in (
        ("num_experts", num_experts),
        ("num_experts_per_tok", top_k),
        ("moe_intermediate_size", width),
        ("decoder_sparse_step", step),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model config: {key} must be a positive integer, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"model config: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
    return {
        "qk_norm": True,
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "norm_topk_prob": bool(norm_topk_prob),
        "sparse_layers": sparse_layers(num_layers, num_experts, mlp_only_layers, step),
    }


def hf_config(get: Getter) -> dict:
    return _moe_fields(
        int(get("num_hidden_layers")),
        get("num_experts", get("num_local_experts")),  # config.json's key; transformers' attribute
        get("num_experts_per_tok"),
        get("moe_intermediate_size"),
        get("norm_topk_prob", False),
        get("mlp_only_layers", ()),
        get("decoder_sparse_step", 1),
    )


def checkpoint_tensor(path: tuple, cfg: ModelConfig) -> CheckpointTensor:
    """An expert weight stack [E, in, out] is E tensors `...mlp.experts.{e}.<proj>.weight`
    ([out, in] each); everything else mirrors transformers' names."""
    parts = [str(p) for p in path]
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in _EXPERT_WEIGHTS:
        base = "model." + ".".join(parts[:-1])
        names = tuple(f"{base}.{e}.{parts[-1]}.weight" for e in range(cfg.num_experts))
        return CheckpointTensor(names, True, stacked_as=f"{base}.{parts[-1]}.weight")
    return mirrored_name(path, cfg)


QWEN3_MOE = Family(
    model=Qwen3MoeForCausalLM,
    tp_layout=llama.TP_LAYOUT,
    hf_config=hf_config,
    checkpoint_tensor=checkpoint_tensor,
)
