"""Test data shared by the paged-attention kernel tests (Pallas and native): random arrays,
the tolerance check, scattered page pools poisoned with NaN wherever no live context
reaches, so a kernel that reads a dead slot fails, and the native kernel called in the dense
layout of ``reference.paged_attention``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import native, reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
DUMMY = 0  # like the engine: padding entries of block tables point at page 0


def native_dense(q, k_pages, v_pages, block_tables, context_lens, positions, scale, k_scales=None, v_scales=None, **kw):
    """``native.ragged_paged_attention`` with ``reference.paged_attention``'s arguments (q [B, T,
    H, D], positions [B, T]): row b owns the flat tokens [b * T, (b + 1) * T), so the dense
    oracle and its tests (decode T = 1, chunks T > 1) check the one native kernel."""
    b, t = q.shape[:2]
    out = native.ragged_paged_attention(
        q.reshape(b * t, *q.shape[2:]),
        k_pages,
        v_pages,
        jnp.arange(b + 1, dtype=jnp.int32) * t,
        context_lens,
        block_tables,
        positions.reshape(b * t),
        scale,
        k_scales,
        v_scales,
        **kw,
    )
    return out.reshape(q.shape)


def randn(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def close(got, want, dtype):
    tol = TOL[dtype]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def page_pool(rng, lens, ps, kvh, d, dtype, extra_pages=3, extra_cols=1, even_width=False):
    """Scattered pages for slots of the given lengths: (clean k, clean v, poisoned k,
    poisoned v, block_tables). Poisoned = NaN everywhere no live context reaches: unused
    pages, the dummy page the tables are padded with, and the tail of each last page.
    even_width: a table width the reference's chunked loop (2 pages a chunk) accepts."""
    need = [-(-n // ps) for n in lens]
    width = max(max(need), 1) + extra_cols
    if even_width:
        width += width % 2
    num_pages = 1 + sum(need) + extra_pages
    order = rng.permutation(np.arange(1, num_pages))
    bt = np.full((len(lens), width), DUMMY, np.int32)
    live = np.zeros((num_pages, ps), bool)
    used = 0
    for b, (n, p) in enumerate(zip(lens, need)):
        bt[b, :p] = order[used : used + p]
        used += p
        j = np.arange(n)
        live[bt[b, j // ps], j % ps] = True
    k = randn(rng, (num_pages, ps, kvh, d), dtype)
    v = randn(rng, (num_pages, ps, kvh, d), dtype)
    dead = jnp.asarray(~live)[:, :, None, None]
    return k, v, jnp.where(dead, jnp.nan, k), jnp.where(dead, jnp.nan, v), jnp.asarray(bt)


def quantize_pool(k, v, k_bad):
    """page_pool's float32 pages as an int8 cache: (poisoned (k, v, k_scales, v_scales), the
    dequantized k and v the oracle reads). int8 holds no NaN, so the scales of every slot no
    live context reaches are NaN instead (a kernel that reads one fails)."""
    dead = jnp.isnan(k_bad[..., 0])
    (qk, sk), (qv, sv) = reference.quantize_kv(k, jnp.int8), reference.quantize_kv(v, jnp.int8)
    bad = (qk, qv, jnp.where(dead, jnp.nan, sk), jnp.where(dead, jnp.nan, sv))
    return bad, reference.dequantize(qk, sk), reference.dequantize(qv, sv)
