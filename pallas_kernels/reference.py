"""Plain jnp attention: the oracle for the Pallas kernels and the CPU serving path.

Shapes: q [B, T, H, D]; pages [num_pages, page_size, KVH, D]; grouped-query attention
folds the H query heads into KVH groups of G = H // KVH so K/V are never repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def _grouped_softmax_attention(q, k, v, mask, scale):
    """q [B,T,H,D], k/v [B,S,KVH,D], mask [B,T,S] -> [B,T,H,D]; softmax in float32."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None, :, :], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)


def causal_attention(q, k, v, scale: float):
    """Dense causal attention over a right-padded batch (no cache): training and parity tests."""
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
    return _grouped_softmax_attention(q, k, v, jnp.broadcast_to(mask, (q.shape[0], t, t)), scale)


def gather_pages(pages, block_tables):
    """[num_pages, ps, KVH, D] x [B, P] -> [B, P*ps, KVH, D]: a slot's context in sequence order."""
    g = pages[block_tables]
    b, p, ps, kvh, d = g.shape
    return g.reshape(b, p * ps, kvh, d)


def paged_attention(q, k_pages, v_pages, block_tables, context_lens, positions, scale: float):
    """Attention of q [B,T,H,D] (token t of slot b at positions[b,t]) over the slot's pages.

    Key j of slot b is visible iff j < context_lens[b] and j <= positions[b, t]. This one
    function serves decode (T=1), chunked prefill and prefill after a prefix-cache hit.
    """
    k = gather_pages(k_pages, block_tables)
    v = gather_pages(v_pages, block_tables)
    j = jnp.arange(k.shape[1])
    mask = (j[None, None, :] < context_lens[:, None, None]) & (j[None, None, :] <= positions[:, :, None])
    return _grouped_softmax_attention(q, k, v, mask, scale)


def write_pages(pages, new, slot_mapping):
    """Scatter new [B,T,KVH,D] into pages at flat slots page*page_size+offset ([B,T])."""
    n, ps, kvh, d = pages.shape
    flat = pages.reshape(n * ps, kvh, d)
    flat = flat.at[slot_mapping.reshape(-1)].set(new.reshape(-1, kvh, d).astype(pages.dtype))
    return flat.reshape(n, ps, kvh, d)
