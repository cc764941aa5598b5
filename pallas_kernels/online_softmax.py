"""The streaming softmax of tiled attention kernels, as jnp on tiles (inside a Pallas kernel or
outside it): scores block by block, a running max m, sum l and accumulator acc per query row,
and the merge of split-K partial results. Scores and accumulators are float32 whatever the
input dtype; masked keys contribute exactly zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# A finite "minus infinity": -inf would give inf - inf = NaN in the running-max correction
# of a row that has seen only masked keys so far.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _precision(a: jax.Array):
    # float32 inputs: full-precision passes (no TF32 / single bf16 pass), as the reference.
    return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b[N, K]^T in float32: the transposed operand is folded into the matmul
    (MXU / tensor cores) instead of materialising k.T."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a), preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a), preferred_element_type=jnp.float32)


def online_softmax_step(m_prev, l_prev, acc_prev, s, mask, v):
    """One block of the streaming softmax: fold scores s [R, C] (float32, already scaled)
    and values v [C, D] into the running max m [R, 1], sum l [R, 1] and accumulator
    acc [R, D]. Masked entries contribute exactly zero, even before the row has seen any
    visible key (when exp(s - m) would be exp(0) = 1). mask None: every entry is visible (a
    block wholly below every row's diagonal and inside its context), no select is emitted."""
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    l_new = l_prev * corr + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = acc_prev * corr + dot_nn(p.astype(v.dtype), v)
    return m_new, l_new, acc_new


def normalise(acc: jax.Array, l: jax.Array) -> jax.Array:
    """acc / l with rows that saw nothing (l == 0) left at zero."""
    return acc / jnp.where(l > 0, l, 1.0)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split-K partial softmaxes: acc [S, ..., D] unnormalised, m/l [S, ...] their
    running max and sum. Rescale every split to the global max (log-sum-exp), then
    normalise once; splits that saw nothing have l == 0 and weigh nothing."""
    m_all = jnp.max(m, axis=0)
    w = jnp.where(l > 0, jnp.exp(m - m_all[None]), 0.0)
    num = jnp.sum(acc * w[..., None], axis=0)
    den = jnp.sum(l * w, axis=0)
    return normalise(num, den[..., None])
