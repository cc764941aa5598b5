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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.kv_math import sparse_layers
from jaxserve.models import linear, llama, qwen3
from jaxserve.models import quantization as quant
from jaxserve.models.contract import EXPERT_AXIS, CheckpointTensor, Family, Getter, mirrored_name
from jaxserve.models.model_config import ModelConfig

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        self.weight = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (cfg.num_experts, cfg.hidden_size), dtype))

    def __call__(self, x):
        """x [N, H] -> router logits [N, E] in float32 (the softmax's precision)."""
        return jnp.dot(x, self.weight[...].T).astype(jnp.float32)


class Int8Stack(nnx.Module):
    """One expert projection of every expert in int8 (``quantization="int8"``): ``weight``
    [E, out, in] (each expert's checkpoint tensor as stored, as an int8 Linear keeps it) and
    ``weight_scale`` [E, out], per output channel as ``models.quantization`` computes them. On an
    abstract module (nnx.eval_shape) only the shapes: the loader fills them."""

    def __init__(self, kernel):
        e, din, dout = kernel.shape  # the float stack [E, in, out] it replaces
        if isinstance(kernel, jax.ShapeDtypeStruct):
            w, s = jax.ShapeDtypeStruct((e, dout, din), jnp.int8), jax.ShapeDtypeStruct((e, dout), jnp.float32)
        else:
            w, s = (jnp.asarray(a) for a in quant.quantize_int8(np.swapaxes(np.asarray(kernel), 1, 2)))
        self.weight = nnx.Param(w)
        self.weight_scale = nnx.Param(s)

    def dequantized(self, dtype):
        """[E, in, out] in `dtype` (the XLA paths: TPU/GPU, expert parallelism)."""
        return jnp.swapaxes(quant.dequantize_int8(self.weight[...], self.weight_scale[...], dtype), 1, 2)


class Experts(nnx.Module):
    """E SwiGLU MLPs, their weights stacked [E, in, out] (or int8: `Int8Stack`).

    On the CPU the runner packs them for the native grouped matmul (`pack_native`, once at
    start): gate and up side by side as one [H, 2F] projection per expert and down [F, H], each
    expert packed as `native_matmul` packs a Linear (bfloat16 pairs, float32 or int8 panels) and
    stacked [E, ...]; a step is then two grouped-matmul calls with the SwiGLU between them."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.normal(std)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), dtype))
        self.hidden, self.width = d, f
        self.quantization = None  # or "int8": each stack an Int8Stack
        self.packed_native = False  # pack_native: gate_up / down panels replace the stacks

    def quantize_stacks(self) -> tuple[str, ...]:
        """Each stack to int8 in place (linear.quantize_modules); the names of those quantized."""
        if self.quantization is not None or self.packed_native:
            return ()
        for name in _EXPERT_WEIGHTS:
            setattr(self, name, Int8Stack(getattr(self, name).get_value()))
        self.quantization = "int8"
        return _EXPERT_WEIGHTS

    def weights(self, dtype) -> tuple:
        """The float stacks gate, up [E, H, F], down [E, F, H] (int8 dequantized to `dtype`)."""
        if self.quantization == "int8":
            return tuple(getattr(self, n).dequantized(dtype) for n in _EXPERT_WEIGHTS)
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]

    def pack_native(self, weight_dtype: str = "float32") -> bool:
        """Replace the stacks by panels for the native grouped matmul, in place, as
        `linear.Linear.pack_native` packs a projection: float32 stacks as float32 panels or, with
        weight_dtype="bfloat16", bfloat16 pairs; int8 as int8 panels (W8A16 pairs where the
        bfloat16 units are). False (nothing changed) for a bfloat16 model's stacks."""
        from pallas_kernels import native_matmul as nm

        if self.packed_native:
            return True
        if self.quantization == "int8":
            pack = nm.pack_int8_bf16 if weight_dtype == "bfloat16" and nm.bf16_units() else nm.pack_int8
            (gq, gs), (uq, us), (dq, ds) = (
                (np.asarray(getattr(self, n).weight[...]), np.asarray(getattr(self, n).weight_scale[...]))
                for n in _EXPERT_WEIGHTS
            )
            gate_up = nm.pack_stack(pack, np.concatenate([gq, uq], axis=1), np.concatenate([gs, us], axis=1))
            down = nm.pack_stack(pack, dq, ds)
        else:
            g, u, d = (np.asarray(getattr(self, n)[...]) for n in _EXPERT_WEIGHTS)
            if g.dtype != np.float32:
                return False
            pack = nm.pack_bf16 if weight_dtype == "bfloat16" else nm.pack
            gate_up, down = (nm.pack_stack(pack, np.concatenate([g, u], axis=2)), None), (nm.pack_stack(pack, d), None)
        for n in _EXPERT_WEIGHTS:
            delattr(self, n)
        self.gate_up, self.down = nnx.Param(jnp.asarray(gate_up[0])), nnx.Param(jnp.asarray(down[0]))
        self.gate_up_scale = nnx.data(None) if gate_up[1] is None else nnx.Param(jnp.asarray(gate_up[1]))
        self.down_scale = nnx.data(None) if down[1] is None else nnx.Param(jnp.asarray(down[1]))
        self.packed_native = True
        return True

    def native_swiglu(self, x, group_sizes):
        """`grouped_swiglu` from the packed stacks (`packed_swiglu`)."""
        gu_scale, down_scale = (None if v is None else v[...] for v in (self.gate_up_scale, self.down_scale))
        return packed_swiglu(
            x,
            self.gate_up[...],
            gu_scale,
            self.down[...],
            down_scale,
            group_sizes,
            width=self.width,
            hidden=self.hidden,
        )


def packed_swiglu(x, gate_up, gate_up_scale, down, down_scale, group_sizes, *, width: int, hidden: int):
    """`grouped_swiglu` from experts packed for the native grouped matmul (`Experts.pack_native`:
    gate_up [E, ...] each expert's [H, 2F], down [E, ...] its [F, H]; scales for int8 only): gate
    and up in one grouped call, the SwiGLU between in float32, down in a second; x's dtype out."""
    from pallas_kernels import native_matmul as nm

    gu = nm.grouped_matmul(x, gate_up, gate_up_scale, group_sizes, n=2 * width)
    act = jax.nn.silu(gu[:, :width]) * gu[:, width:]
    return nm.grouped_matmul(act, down, down_scale, group_sizes, n=hidden).astype(x.dtype)


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


def routed_experts(h, weights, chosen, swiglu, local_experts: int, *, first_expert, num_experts: int, live=None):
    """The weighted sum of each token's chosen experts among experts first_expert ..
    first_expert + local_experts - 1 (all E on one device, E / ep on each of ep); pairs routed to
    other experts contribute zero. h [N, H]; weights, chosen [N, k]; swiglu(x_sorted, group_sizes)
    the grouped SwiGLU over those experts (`grouped_swiglu` or `Experts.native_swiglu`); live
    (an int32 scalar or None): only the first `live` tokens are real (a ragged step's bucket
    padding), the rest are routed nowhere and come out as zeros.

    The pairs are sorted with this shard's experts first ((expert - first) mod E), so its
    groups are the leading rows and one grouped SwiGLU over G groups computes them. Each token's k
    outputs are summed in its own order, so its result does not depend on the rest of the step."""
    n, k = chosen.shape
    rel = (chosen.reshape(-1) - first_expert) % num_experts  # pair i = (token i // k, its (i % k)-th expert)
    if live is not None:  # padding tokens' pairs: past every group (bincount drops them), so no rows run
        rel = jnp.where(jnp.arange(n * k) // k < live, rel, num_experts)
    order = jnp.argsort(rel, stable=True)
    group_sizes = jnp.bincount(rel, length=num_experts)[:local_experts].astype(jnp.int32)
    out = swiglu(h[order // k], group_sizes)
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
            if self.experts.packed_native:
                swiglu = self.experts.native_swiglu
            else:
                gate, up, down = self.experts.weights(x.dtype)
                swiglu = functools.partial(_swiglu_of, gate, up, down)
            out = routed_experts(
                h,
                weights,
                chosen,
                swiglu,
                self.num_experts,
                first_expert=0,
                num_experts=self.num_experts,
                live=linear.current_live_rows(),
            )
        else:
            out = expert_parallel(self.mesh, self.num_experts)(h, weights, chosen, *self.experts.weights(x.dtype))
        return out.reshape(shape)


def _swiglu_of(gate, up, down, x, group_sizes):
    return grouped_swiglu(x, gate, up, down, group_sizes)


def expert_parallel(mesh, num_experts: int):
    """`routed_experts` with the experts split over the mesh's expert axis: each device runs its
    own E / ep experts for every token of the step (all of them are on every device), and one
    psum adds the devices' partial sums. Inputs and output are replicated; the expert stacks
    are split on their leading axis."""

    def per_device(h, weights, chosen, gate, up, down):
        first = jax.lax.axis_index(EXPERT_AXIS) * gate.shape[0]
        swiglu = functools.partial(_swiglu_of, gate, up, down)
        part = routed_experts(h, weights, chosen, swiglu, gate.shape[0], first_expert=first, num_experts=num_experts)
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
    ([out, in] each); int8 (`Int8Stack`) its weight [E, out, in] is the same E tensors, not
    transposed, and its scales [E, out] the `..._scale` the loader computes beside each;
    everything else mirrors transformers' names."""
    parts = [str(p) for p in path]
    if len(parts) >= 3 and parts[-3] == "experts" and parts[-2] in _EXPERT_WEIGHTS:  # Int8Stack: weight, weight_scale
        base = "model." + ".".join(parts[:-2])
        names = tuple(f"{base}.{e}.{parts[-2]}.{parts[-1]}" for e in range(cfg.num_experts))
        return CheckpointTensor(names, False, stacked_as=f"{base}.{parts[-2]}.{parts[-1]}")
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
