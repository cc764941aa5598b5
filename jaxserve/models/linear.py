"""jaxserve's linear layer: the one place that knows how a projection's weights are stored
in a checkpoint, laid out on the device and split across chips.

A plain ``y = x @ kernel + bias`` today (computed as ``nnx.Linear`` computes it, so outputs
are unchanged). Loading (transformers stores ``weight`` as [out, in]; the kernel is
[in, out]), tensor-parallel placement (column- or row-parallel) and, later, quantized
storage with its scales all hang off this class instead of off string matching scattered
through the loader and the sharding rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

COLUMN, ROW, REPLICATED = "column", "row", "replicated"


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs, std: float):
        self.kernel = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (din, dout), dtype))
        if bias:
            self.bias = nnx.Param(nnx.initializers.zeros(rngs.params(), (dout,), dtype))
        else:
            self.bias = nnx.data(None)
        self.dtype = dtype

    def __call__(self, x):
        x = x.astype(self.dtype)
        y = jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))
        if self.bias is not None:
            y = y + jnp.reshape(self.bias[...], (1,) * (y.ndim - 1) + (-1,))
        return y


def checkpoint_tensor(leaf: str) -> tuple[str, bool]:
    """A Linear parameter's transformers tensor suffix and whether it is stored transposed."""
    return ("weight", True) if leaf == "kernel" else (leaf, False)


def partition_spec(leaf: str, layout: str, axis: str) -> P:
    """Column-parallel splits the output features (kernel columns and the bias), so each chip
    computes its own heads; row-parallel splits the input features (kernel rows), and the
    partial sums are reduced; the bias is added once, replicated."""
    if layout == COLUMN:
        return P(None, axis) if leaf == "kernel" else P(axis)
    if layout == ROW and leaf == "kernel":
        return P(axis, None)
    return P()
