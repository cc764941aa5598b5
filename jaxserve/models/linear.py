"""jaxserve's linear layer: the one place that knows how a projection's weights are stored
in a checkpoint, laid out on the device and split across chips.

In full precision a plain ``y = x @ kernel + bias`` (computed as ``nnx.Linear`` computes it),
the kernel [in, out] (transformers stores ``weight`` as [out, in]: loading transposes it).
Quantized (``to_int8``, done by the loader with ``quantization="int8"``) the kernel is replaced
by ``weight`` int8 [out, in] (the checkpoint's own layout: each output channel's weights are
contiguous, which the native CPU kernel streams) and ``weight_scale`` float32 [out], one
symmetric scale per output channel (``models.quantization``); ``y = int8_matmul(x, weight,
weight_scale) + bias``, computed by XLA (dequantize, then dot).

On the CPU the runner then packs every Linear for the native matmul (``pack_native``, done once
at start; ``pallas_kernels.native_matmul``): ``packed`` [ceil(out / 64), in, 64] float32 or int8
panels (and ``weight_scale`` padded to a whole panel), which the kernel streams once per step at
memory speed where XLA:CPU's GEMM reads weights at half of it from 8 rows up. With
``weight_dtype="bfloat16"`` (the engine's ``matmul_dtype``, default on a CPU with AMX or AVX512-BF16) a float
kernel is packed instead as bfloat16 AMX tiles [ceil(out / 64), ceil(in / 32), 2048]: half the
bytes, and the tile unit's throughput for prefill; x stays float32 (rounded in the kernel). An
AVX2 host runs the same blocks in float32 arithmetic (half the bytes only). int8 weights are
then packed in the same blocks for the bfloat16 units (widened to bfloat16 in the kernel,
W8A16): a quarter of float32's bytes and bfloat16's arithmetic; without those units they keep
their float32-arithmetic panels. A tensor-parallel
runner does not pack (XLA's partitioner cannot split a custom call), nor does a TPU/GPU.

Loading, tensor-parallel placement (column- or row-parallel; the scales split with their output
channels when those are split, replicated otherwise) and the storage all hang off this class
instead of off string matching scattered through the loader and the sharding rules.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.models import quantization as quant

# How many leading rows of the activations are real tokens while a model traces a ragged step
# (`live_rows`); None: all of them.
_LIVE_ROWS: contextvars.ContextVar = contextvars.ContextVar("live_rows", default=None)


@contextlib.contextmanager
def live_rows(n):
    """Within this block, the native CPU matmul multiplies only the first `n` rows (a traced
    int32 scalar: the step's real tokens) and zeroes the rest: a token bucket's padding costs
    no arithmetic. Set by the model around its decoder layers while tracing; XLA's dot and the
    accelerators ignore it (their padded rows cost what they cost)."""
    token = _LIVE_ROWS.set(n)
    try:
        yield
    finally:
        _LIVE_ROWS.reset(token)


def current_live_rows():
    """The live-row count set by the enclosing `live_rows` block (None outside one): layers
    other than Linear that skip padding tokens themselves (a mixture of experts' routing) read it."""
    return _LIVE_ROWS.get()


COLUMN, ROW, REPLICATED = "column", "row", "replicated"
LEAVES = ("kernel", "bias", "weight", "weight_scale")  # a Linear's parameters, quantized or not (unpacked)


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs, std: float):
        self.kernel = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (din, dout), dtype))
        if bias:
            self.bias = nnx.Param(nnx.initializers.zeros(rngs.params(), (dout,), dtype))
        else:
            self.bias = nnx.data(None)
        self.dtype = dtype
        self.quantization = None  # or "int8": weight + weight_scale replace kernel
        self.out_features = dout
        self.packed_native = False  # pack_native: panels for the native CPU matmul replace both

    def to_int8(self) -> None:
        """Replace the float kernel by int8 weights and per-output-channel scales, in place. On
        an abstract module (nnx.eval_shape) only the shapes change: the loader fills them."""
        kernel = self.kernel.get_value()
        din, dout = kernel.shape
        if isinstance(kernel, jax.ShapeDtypeStruct):
            w, s = jax.ShapeDtypeStruct((dout, din), jnp.int8), jax.ShapeDtypeStruct((dout,), jnp.float32)
        else:
            w, s = (jnp.asarray(a) for a in quant.quantize_int8(jnp.asarray(kernel).T))
        del self.kernel
        self.weight = nnx.Param(w)
        self.weight_scale = nnx.Param(s)
        self.quantization = "int8"

    def absorb(self, others: list[Linear]) -> None:
        """Append the output features of `others` (same input, same storage) to this layer's, in
        place: one product then computes all of them (q/k/v, gate/up), and the caller splits the
        result at the old widths. Quantization is per output channel, so int8 weights and their
        scales concatenate as they are."""
        layers = [self, *others]
        if any(m.packed_native or m.quantization != self.quantization for m in layers):
            raise ValueError("absorb: every layer must be unpacked and stored alike")
        if self.quantization == "int8":
            self.weight = nnx.Param(jnp.concatenate([m.weight[...] for m in layers], axis=0))
            self.weight_scale = nnx.Param(jnp.concatenate([m.weight_scale[...] for m in layers], axis=0))
        else:
            self.kernel = nnx.Param(jnp.concatenate([m.kernel[...] for m in layers], axis=1))
        if self.bias is not None:
            self.bias = nnx.Param(jnp.concatenate([m.bias[...] for m in layers], axis=0))
        self.out_features = sum(m.out_features for m in layers)

    def native_storage(self) -> bool:
        """Unpacked weights the native CPU matmul takes: int8, or a float32 kernel."""
        return self.quantization == "int8" or self.kernel[...].dtype == jnp.float32

    def pack_native(self, weight_dtype: str = "float32") -> bool:
        """Replace the kernel (or int8 weight) by panels for the native CPU matmul, in place:
        a float32 kernel as float32 panels or, with weight_dtype="bfloat16", as bfloat16 AMX
        tiles; int8 weights stay int8, laid out for float32 arithmetic or, with
        weight_dtype="bfloat16", for the bfloat16 units (widened in the kernel: W8A16). False
        (nothing changed) for weights it does not take (a bfloat16 model's kernel)."""
        from pallas_kernels import native_matmul

        if self.packed_native:
            return True
        if not self.native_storage():
            return False
        if self.quantization == "int8":  # W8A16 needs the bfloat16 units; float32 arithmetic elsewhere
            w8a16 = weight_dtype == "bfloat16" and native_matmul.bf16_units()
            pack = native_matmul.pack_int8_bf16 if w8a16 else native_matmul.pack_int8
            w, s = pack(np.asarray(self.weight[...]), np.asarray(self.weight_scale[...]))
            del self.weight
            self.weight_scale = nnx.Param(jnp.asarray(s))
        elif weight_dtype == "bfloat16":
            w = native_matmul.pack_bf16(np.asarray(self.kernel[...]))
            del self.kernel
        else:
            w = native_matmul.pack(np.asarray(self.kernel[...]))
            del self.kernel
        self.packed = nnx.Param(jnp.asarray(w))
        self.packed_native = True
        return True

    def __call__(self, x):
        x = x.astype(self.dtype)
        if self.packed_native:
            from pallas_kernels import native_matmul

            scale = self.weight_scale[...] if self.quantization == "int8" else None
            y = native_matmul.matmul(x, self.packed[...], scale, n=self.out_features, live_rows=_LIVE_ROWS.get())
            y = y.astype(self.dtype)
        elif self.quantization == "int8":
            y = quant.int8_matmul(x, self.weight[...], self.weight_scale[...])
        else:
            y = jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))
        if self.bias is not None:
            y = y + jnp.reshape(self.bias[...], (1,) * (y.ndim - 1) + (-1,))
        return y


def checkpoint_tensor(leaf: str) -> tuple[str, bool]:
    """A Linear parameter's transformers tensor suffix and whether it is stored transposed
    (an int8 ``weight`` keeps the checkpoint's [out, in]; its ``weight_scale`` is computed at
    load, named as compressed-tensors checkpoints name theirs)."""
    return ("weight", True) if leaf == "kernel" else (leaf, False)


def quantize_modules(module: nnx.Module, mode: str | None, keep: tuple[str, ...] = ()) -> list[tuple]:
    """Quantize every Linear in ``module`` (abstract or not) in place, except those whose
    attribute name is in ``keep`` (e.g. "lm_head"), and the weight stacks of modules with a
    ``quantize_stacks`` method (a mixture of experts: each stack becomes a module holding
    ``weight`` and ``weight_scale`` as a Linear does); returns the paths of the quantized ones
    (a Linear's, or a stack's), each holding ``weight`` and ``weight_scale`` (the loader fills them)."""
    quant.check_mode(mode)
    done = []
    if mode is None:
        return done
    for path, m in list(nnx.iter_modules(module)):
        if path and str(path[-1]) in keep:
            continue
        if isinstance(m, Linear) and m.quantization is None:
            m.to_int8()
            done.append(path)
        elif callable(getattr(m, "quantize_stacks", None)):  # stacked weights (a MoE layer's experts)
            done.extend((*path, name) for name in m.quantize_stacks())
    return done


def pack_native(module: nnx.Module, weight_dtype: str = "float32") -> int:
    """Pack every Linear in ``module`` for the native CPU matmul (Linear.pack_native; float
    kernels as ``weight_dtype`` panels), first
    fusing the projections that share an input (modules with a ``fuse_projections`` method:
    q/k/v, gate/up), since each product is a call whose start costs tens of microseconds while
    the second core wakes; other modules with a ``pack_native(weight_dtype)`` method (a MoE layer's
    experts, for the grouped native matmul) pack themselves; returns how many were packed."""
    for _, m in list(nnx.iter_modules(module)):
        fuse = getattr(m, "fuse_projections", None)
        if fuse is not None and _packable(m):
            fuse()
    return sum(
        m.pack_native(weight_dtype)
        for _, m in list(nnx.iter_modules(module))
        if callable(getattr(m, "pack_native", None))
    )


def _packable(module: nnx.Module) -> bool:
    """Every Linear under `module` is one pack_native takes (float32 or int8, not yet packed)."""
    return all(not m.packed_native and m.native_storage() for _, m in nnx.iter_modules(module) if isinstance(m, Linear))


def partition_spec(leaf: str, layout: str, axis: str) -> P:
    """Column-parallel splits the output features (kernel columns, int8 weight rows, their
    scales and the bias), so each chip computes its own heads; row-parallel splits the input
    features (kernel rows, int8 weight columns), and the partial sums are reduced; the bias and
    the scales are then replicated (each output channel's scale applies to every partial sum)."""
    if layout == COLUMN:
        return {"kernel": P(None, axis), "weight": P(axis, None)}.get(leaf, P(axis))
    if layout == ROW and leaf in ("kernel", "weight"):
        return P(axis, None) if leaf == "kernel" else P(None, axis)
    return P()
