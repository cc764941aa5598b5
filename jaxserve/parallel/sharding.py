"""Tensor parallelism: parameters and KV page pools sharded over a mesh axis "tp".

Megatron-style: q/k/v and gate/up projections split by columns (heads, MLP features), o and
down projections by rows, so each layer needs one all-reduce after attention and one after
the MLP, which XLA's SPMD partitioner inserts. KV pages are split by KV head; with fewer KV
heads than chips, the K/V projections and pages are replicated instead. Everything else is
replicated. The jitted steps are unchanged: shardings travel with the arrays, and the KV
cache is pinned to its sharding on output so donation and the compile cache stay stable.

Expert parallelism adds a mesh axis "expert" (ep devices) in front of "tp": the mesh is ep x tp
devices, attention and dense layers split over "tp" and repeat along "expert", and a
mixture-of-experts layer's stacked experts ([E, in, out]) split over "expert" on their leading
axis (E / ep each); the layer itself dispatches inside a shard_map (models/qwen3_moe.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.models.contract import EXPERT_AXIS, MeshAware
from jaxserve.models.model_config import ModelConfig

AXIS = "tp"


def make_mesh(tp: int, devices=None, ep: int = 1) -> Mesh:
    """A ("tp",) mesh of tp devices, or with expert parallelism an ("expert", "tp") mesh of
    ep x tp (the first ep * tp devices)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size must be in [1, {len(devices)}] (devices available), got {tp}")
    if ep == 1:
        return Mesh(np.array(devices[:tp]), (AXIS,))
    if ep < 1 or len(devices) % ep or ep * tp > len(devices):
        raise ValueError(
            f"expert_parallel_size must divide the device count ({len(devices)}) and expert_parallel_size x "
            f"tensor_parallel_size ({ep} x {tp}) must not exceed it, got expert_parallel_size={ep}"
        )
    return Mesh(np.array(devices[: ep * tp]).reshape(ep, tp), (EXPERT_AXIS, AXIS))


def check_expert_parallel(cfg: ModelConfig, ep: int) -> None:
    """Expert parallelism needs a mixture-of-experts model whose experts divide evenly."""
    if ep == 1:
        return
    if not cfg.num_experts:
        raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; {cfg.architecture} has none")
    if cfg.num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide the model's num_experts ({cfg.num_experts})")


def bind_mesh(module, mesh: Mesh) -> None:
    """Give every layer that shards its own work (models.contract.MeshAware) the mesh, before
    the model is split into graph and state (the mesh travels as static graph data)."""
    from flax import nnx

    for _, m in nnx.iter_modules(module):
        if isinstance(m, MeshAware):
            m.use_mesh(mesh)


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    for name, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name} ({n})")


def kv_heads_sharded(cfg: ModelConfig, tp: int) -> bool:
    return cfg.num_kv_heads % tp == 0


def param_spec(path: tuple, ndim: int, cfg: ModelConfig, tp: int, ep: int = 1) -> P:
    """A parameter's placement: the model's family says how each projection splits (its
    `tp_layout`), the Linear layer how that layout maps onto its kernel and bias; the rest is
    replicated. K/V projections stay replicated when their heads do not divide by the chip
    count, and the LM head when the vocabulary does not. With ep > 1 everything under an
    `experts` module (stacked [E, ...]) splits over the expert axis by its leading dimension."""
    from jaxserve.models import linear, registry

    names = [str(p) for p in path]
    if ep > 1 and "experts" in names[:-1]:
        return P(EXPERT_AXIS, *([None] * (ndim - 1)))
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
    layout = registry.family(cfg.architecture).tp_layout.get(owner) if leaf in linear.LEAVES else None
    if (owner in ("k_proj", "v_proj") and not kv_heads_sharded(cfg, tp)) or (
        owner == "lm_head" and cfg.vocab_size % tp
    ):
        layout = None
    if layout is None:
        return P(*([None] * ndim))
    return linear.partition_spec(leaf, layout, AXIS)


def shard_params(state, cfg: ModelConfig, mesh: Mesh):
    """Place an nnx State on the mesh by the rules above."""
    from flax import nnx

    tp, ep = mesh.shape[AXIS], dict(mesh.shape).get(EXPERT_AXIS, 1)
    flat = nnx.to_flat_state(state)
    placed = []
    for path, var in flat:
        value = np.asarray(var.get_value())
        sharding = NamedSharding(mesh, param_spec(path, value.ndim, cfg, tp, ep))
        # from a host copy, each process placing only its own shards (works across hosts)
        placed.append((path, var.replace(jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i]))))
    return nnx.from_flat_state(placed)


HEADS = P(None, None, AXIS, None)  # [.., .., heads, head_dim] split by head: q, k, v, pages, outputs
SCALE_HEADS = P(None, None, AXIS)  # [num_pages, page_size, heads]: an 8-bit cache's scales, with their heads


def kv_spec(cfg: ModelConfig, tp: int, quantized: bool = False) -> P | tuple[P, ...]:
    """Where a KV page pool lives: split by KV head, or replicated when the heads do not divide
    by the chip count. quantized: the specs of one layer's (k_pages, v_pages, k_scales,
    v_scales), the scales split with their heads."""
    sharded = kv_heads_sharded(cfg, tp)
    pages = HEADS if sharded else P()
    if not quantized:
        return pages
    scales = SCALE_HEADS if sharded else P()
    return (pages, pages, scales, scales)


def kv_sharding(cfg: ModelConfig, mesh: Mesh, quantized: bool = False):
    """The sharding of the whole KV cache (every layer's tuple): one NamedSharding for plain
    pages, a tuple per layer of (pages, pages, scales, scales) shardings for an 8-bit cache."""
    spec = kv_spec(cfg, mesh.shape[AXIS], quantized)
    if not quantized:
        return NamedSharding(mesh, spec)
    return (tuple(NamedSharding(mesh, s) for s in spec),) * cfg.num_layers


def shard_attention(attn_fn: Callable, cfg: ModelConfig, mesh: Mesh) -> Callable:
    """Run an attention kernel per chip on its own heads (shard_map), for Pallas kernels.

    XLA's partitioner cannot split a Pallas custom call: left to it, every chip would gather
    the whole page pool and all heads before each attention. Attention is independent per
    head, so each chip runs the kernel on its query heads and their KV heads, and the result
    stays split by heads for o_proj's row-parallel matmul. With fewer KV heads than chips (KV
    replicated), each chip slices the one KV head its query heads share. Where a chip's query
    heads would straddle two KV groups, the kernel is returned unwrapped (correct, not local)."""
    tp = mesh.shape[AXIS]
    kv_sharded = kv_heads_sharded(cfg, tp)
    local_heads, group = cfg.num_heads // tp, cfg.num_heads // cfg.num_kv_heads
    if not kv_sharded and group % local_heads:
        return attn_fn
    kv = kv_spec(cfg, tp)

    def per_chip(q, k, v, kv_pages, meta, *, scale, window=None):
        # kv_pages: (k_pages, v_pages), or with an 8-bit cache (k_pages, v_pages, k_scales,
        # v_scales); scales [num_pages, page_size, KVH] follow their heads (axis 2 too)
        if not kv_sharded:
            head = lax.axis_index(AXIS) * local_heads // group
            k, v = (lax.dynamic_slice_in_dim(x, head, 1, axis=2) for x in (k, v))
            kv_pages = tuple(lax.dynamic_slice_in_dim(x, head, 1, axis=2) for x in kv_pages)
        return attn_fn(q, k, v, tuple(kv_pages), meta, scale=scale, **({"window": window} if window else {}))

    def wrapped(q, k, v, kv_pages, meta, *, scale, window=None):
        meta_spec = jax.tree.map(lambda _: P(), meta)
        cache_spec = kv_spec(cfg, tp, quantized=True) if len(kv_pages) == 4 else (kv, kv)
        body = jax.shard_map(
            functools.partial(per_chip, scale=scale, window=window),
            mesh=mesh,
            out_specs=HEADS,
            check_vma=False,
            in_specs=(HEADS, kv, kv, cache_spec, meta_spec),
        )
        return body(q, k, v, kv_pages, meta)

    return wrapped
