"""Plain jnp attention: the oracle for the Pallas kernels and the CPU serving path.

Shapes: q [B, T, H, D]; pages [num_pages, page_size, KVH, D]; grouped-query attention
folds the H query heads into KVH groups of G = H // KVH so K/V are never repeated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's new K/V go and what each query may see (all int32). Every attention
    function takes ``(q, k, v, kv_pages, meta)``: one type, so a new field (a scale, a mask)
    is added here once instead of to every signature."""

    slot_mapping: jax.Array  # [B, T] flat page slot page*page_size+offset; padding -> the dummy page 0
    block_tables: jax.Array  # [B, P] each row's pages in sequence order
    context_lens: jax.Array  # [B] valid keys once this step's K/V are written
    positions: jax.Array  # [B, T] each query's position in its sequence
    segment_ids: jax.Array  # [B, T] which packed prompt a token belongs to (fresh prefill)


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


def causal_attention(q, k, v, scale: float, segment_ids=None):
    """Dense causal attention over a right-padded batch (no cache): training, parity tests and
    fresh prompts. segment_ids [B, T] packs several prompts in one row: a token sees only
    earlier tokens of its own segment."""
    t = q.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool))[None], (q.shape[0], t, t))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return _grouped_softmax_attention(q, k, v, mask, scale)


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


def paged_attention_chunked(
    q, k_pages, v_pages, block_tables, context_lens, positions, scale: float, pages_per_chunk: int = 2
):
    """Paged attention as a loop over chunks of pages with an online softmax: flash-decoding
    in plain XLA. Same semantics as paged_attention (key j visible iff j < context_lens[b]
    and j <= positions[b, t]) but it never materialises a slot's whole context: on the CPU
    that is several times faster (XLA's gather of a large [B, S] context is slow, and the
    loop's working set stays in cache), and the trip count follows the longest live context,
    so one compiled step serves every length.

    q [B, T, H, D]; block_tables [B, P] with P a multiple of pages_per_chunk; -> [B, T, H, D].
    """
    b, t, h, d = q.shape
    _, ps, kvh, _ = k_pages.shape
    g = h // kvh
    c = pages_per_chunk
    span = c * ps
    qg = (q.astype(jnp.float32) * scale).reshape(b, t, kvh, g, d)
    n_chunks = (jnp.max(context_lens) + span - 1) // span
    limit = jnp.minimum(context_lens[:, None], positions + 1)  # [B, T]: keys j < limit are visible

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(block_tables, i * c, c, axis=1)
        k = k_pages[pages].reshape(b, span, kvh, d).astype(jnp.float32)
        v = v_pages[pages].reshape(b, span, kvh, d).astype(jnp.float32)
        s = jnp.einsum("btkgd,bskd->btkgs", qg, k)
        pos = i * span + jnp.arange(span)
        s = jnp.where(pos[None, None, None, None, :] < limit[:, :, None, None, None], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum("btkgs,bskd->btkgd", p, v)

    init = (
        jnp.full((b, t, kvh, g), _NEG, jnp.float32),
        jnp.zeros((b, t, kvh, g), jnp.float32),
        jnp.zeros((b, t, kvh, g, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(b, t, h, d).astype(q.dtype)


def attention(q, k, v, kv_pages, meta: AttentionMetadata, *, scale: float, mode: str):
    """The XLA serving path, by step kind (static). k/v are this step's new keys and values,
    kv_pages the (k_pages, v_pages) pools with them already written:
    - "prefill": fresh prompts (packed, one segment each) attend only to themselves, so use
      the new K/V directly (no gather);
    - "context" (a chunk continuing a sequence: chunked prefill, prefix-cache hit, speculative
      verification) and "decode" (one query per slot): the chunked online-softmax loop over
      the slot's pages. (paged_attention, which gathers the whole context, is the oracle.)"""
    if mode == "prefill":
        return causal_attention(q, k, v, scale, meta.segment_ids)
    k_pages, v_pages = kv_pages
    block_tables, context_lens, positions = meta.block_tables, meta.context_lens, meta.positions
    pad = (-block_tables.shape[1]) % 2
    if pad:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    # Rows come sorted by context length (longest first): attending in groups lets each
    # group's loop stop at its own longest context instead of the batch's.
    b = q.shape[0]
    groups = max(1, min(4, b // 8))
    if b % groups:
        groups = 1
    n = b // groups
    return jnp.concatenate(
        [
            paged_attention_chunked(
                q[i : i + n],
                k_pages,
                v_pages,
                block_tables[i : i + n],
                context_lens[i : i + n],
                positions[i : i + n],
                scale,
            )
            for i in range(0, b, n)
        ],
        axis=0,
    )
