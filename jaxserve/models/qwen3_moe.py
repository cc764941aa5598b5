"""Qwen3-MoE: Qwen3's attention with a routed mixture of experts in place of most MLPs.

As transformers' `Qwen3MoeSparseMoeBlock` computes it: the router's logits (`mlp.gate`, [E, H],
no bias) go through a float32 softmax, each token keeps its `num_experts_per_tok` most likely
experts, and with `norm_topk_prob` those k weights are renormalised to sum to one; each chosen
expert is a SwiGLU MLP of width `moe_intermediate_size`, and the token's output is the
weighted sum of its experts' outputs. A layer is sparse unless it is in `mlp_only_layers` or
`(layer + 1) % decoder_sparse_step != 0`; those keep a dense MLP of `intermediate_size`.

The experts run as one grouped SwiGLU: the (token, expert) pairs are sorted by expert and each
expert's contiguous rows are multiplied by that expert's weights (stacked [E, in, out];
`grouped_swiglu`: `jax.lax.ragged_dot` on TPU and GPU, a loop over fixed-height tiles of the
rows on the CPU), with fixed shapes (N tokens x k pairs). Each token's k outputs are then summed in its own
order, so a token's result does not depend on what else is in its step.

A checkpoint stores one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...);
`checkpoint_tensor` names them so the loader stacks them. Under tensor parallelism alone the
experts and the router are replicated; attention and the dense layers split as Llama's do.

Expert parallelism (a mesh axis `EXPERT_AXIS` of size ep beside "tp"): each device holds E / ep
consecutive experts. The engine has no data parallelism, so every device already holds every
token of the step (the activations are replicated after attention's all-reduce); dispatch is
therefore local: in a `jax.shard_map` each device sorts the (token, expert) pairs with its own
experts first, runs the grouped matmul over its E / ep experts only, zeroes the pairs another
device owns, and one `psum` over the expert axis combines the partial sums. That is the same
one all-reduce a row-parallel matmul costs; an all-to-all would first have to split the tokens
across devices and gather them back, which only pays once attention is data-parallel
(docs/models.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.kv_math import sparse_layers
from jaxserve.models import llama, qwen3
from jaxserve.models.contract import EXPERT_AXIS, CheckpointTensor, Family, Getter, mirrored_name
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

    def weights(self) -> tuple:
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]


def grouped_swiglu(x, gate, up, down, group_sizes):
    """x [M, H]: rows sorted by expert; gate/up [G, H, F], down [G, F, H]: G experts' weights;
    group_sizes [G] how many rows each has (rows past their sum come out as zeros).

    Each expert's rows are cut into tiles of a fixed height, and a loop runs only the tiles that
    hold rows: a tile is one expert's whole SwiGLU on up to `tile` rows, so a step reads each
    chosen expert's weights once per tile of its rows and skips the experts nobody chose.
    (`jax.lax.ragged_dot` computes the same, but XLA:CPU runs it ~50x slower than its bound:
    25 ms for 128 rows over 32 experts of 512x256, where one expert's 128 rows take 0.5 ms.)
    A row's arithmetic is a [tile, H] product whatever else is in the step. On TPU and GPU,
    whose compilers have grouped-matmul kernels for it, this is `ragged_dot`."""
    if jax.default_backend() != "cpu":
        gx, ux = jax.lax.ragged_dot(x, gate, group_sizes), jax.lax.ragged_dot(x, up, group_sizes)
        return jax.lax.ragged_dot(jax.nn.silu(gx) * ux, down, group_sizes)
    m, g = x.shape[0], gate.shape[0]
    tile = 8 if m <= 512 else 32
    tiles = (group_sizes + tile - 1) // tile  # [G] tiles per expert
    tile_end = jnp.cumsum(tiles)
    row_end = jnp.cumsum(group_sizes)
    t = jnp.arange(-(-m // tile) + g)  # at most this many tiles hold rows
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), g - 1)
    start = (row_end - group_sizes)[expert] + (t - (tile_end - tiles)[expert]) * tile
    xp = jnp.concatenate([x, jnp.zeros((tile, x.shape[1]), x.dtype)])  # a tile never reads past the end

    def one_tile(i, out):
        s, e = start[i], expert[i]
        xs = jax.lax.dynamic_slice_in_dim(xp, s, tile)
        y = ((jax.nn.silu(xs @ gate[e]) * (xs @ up[e])) @ down[e]).astype(out.dtype)
        keep = (s + jnp.arange(tile) < row_end[e])[:, None]
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, s, tile)), s, 0
        )

    out = jax.lax.fori_loop(0, tile_end[-1], one_tile, jnp.zeros((m + tile, down.shape[-1]), x.dtype))
    return out[:m]


def routed_experts(h, weights, chosen, gate, up, down, *, first_expert, num_experts: int):
    """The weighted sum of each token's chosen experts among experts first_expert ..
    first_expert + G - 1 (G = gate.shape[0]: all E on one device, E / ep on each of ep);
    pairs routed to other experts contribute zero. h [N, H]; weights, chosen [N, k].

    The pairs are sorted with this shard's experts first ((expert - first) mod E), so its
    groups are the leading rows and one grouped SwiGLU over G groups computes them. Each token's k
    outputs are summed in its own order, so its result does not depend on the rest of the step."""
    n, k = chosen.shape
    local_experts = gate.shape[0]
    rel = (chosen.reshape(-1) - first_expert) % num_experts  # pair i = (token i // k, its (i % k)-th expert)
    order = jnp.argsort(rel, stable=True)
    group_sizes = jnp.bincount(rel, length=num_experts)[:local_experts].astype(jnp.int32)
    out = grouped_swiglu(h[order // k], gate, up, down, group_sizes)
    per_pair = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)  # back in token order
    mine = (rel < local_experts).reshape(n, k, 1)
    return jnp.sum(jnp.where(mine, per_pair, 0) * weights[..., None], axis=1)


class SparseMoe(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        self.gate = Router(cfg, dtype, rngs, std)
        self.experts = Experts(cfg, dtype, rngs, std)
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.mesh = None  # set by use_mesh when the experts are split over an expert axis

    def use_mesh(self, mesh) -> None:
        """Run the experts expert-parallel when `mesh` has an expert axis of more than one device
        (models.contract.MeshAware); otherwise XLA places them (replicated under tensor parallelism)."""
        self.mesh = mesh if dict(mesh.shape).get(EXPERT_AXIS, 1) > 1 else None

    def __call__(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = jax.nn.softmax(self.gate(h), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)
        if self.mesh is None:
            out = routed_experts(
                h, weights, chosen, *self.experts.weights(), first_expert=0, num_experts=self.num_experts
            )
        else:
            out = expert_parallel(self.mesh, self.num_experts)(h, weights, chosen, *self.experts.weights())
        return out.reshape(shape)


def expert_parallel(mesh, num_experts: int):
    """`routed_experts` with the experts split over the mesh's expert axis: each device runs its
    own E / ep experts for every token of the step (all of them are on every device), and one
    psum adds the devices' partial sums. Inputs and output are replicated; the expert stacks
    are split on their leading axis."""

    def per_device(h, weights, chosen, gate, up, down):
        first = jax.lax.axis_index(EXPERT_AXIS) * gate.shape[0]
        part = routed_experts(h, weights, chosen, gate, up, down, first_expert=first, num_experts=num_experts)
        return jax.lax.psum(part, EXPERT_AXIS)

    split = P(EXPERT_AXIS)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(), P(), P(), split, split, split),
        out_specs=P(),
        check_vma=False,
    )


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
