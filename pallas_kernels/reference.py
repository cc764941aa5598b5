"""Plain jnp attention: the oracle for the Pallas kernels and the CPU serving path.

Shapes: q [B, T, H, D]; pages [num_pages, page_size, KVH, D]; grouped-query attention
folds the H query heads into KVH groups of G = H // KVH so K/V are never repeated.

A layer's KV cache is ``(k_pages, v_pages)`` or, quantized (``kv_cache_dtype`` "int8" or
"fp8"), ``(k_pages, v_pages, k_scales, v_scales)``: int8 / float8_e4m3fn pages and bfloat16
scales [num_pages, page_size, KVH], one per token per head (``quantize_kv``). Every reader
dequantizes per token while it reads and computes in float32; ``write_kv`` is the one write
path, so every attention implementation sees the same bytes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedMetadata:
    """A ragged step's attention inputs (all int32): one flat array of N query tokens in rows of
        any length (1 for decode, a chunk for prefill, k + 1 for speculative verification). Row r
        owns tokens [query_start_loc[r], query_start_loc[r + 1]) and reads its keys through
        block_tables[r]; token n of row r sees key j iff j < seq_lens[r] and j <= positions[n].
        Tokens past query_start_loc[R] are padding: they write to the dummy page and see nothing.
    A layer with a sliding window W (the attention call's `sliding_window`) also hides key j from
    token n when j <= positions[n] - W: each token sees its last W positions, itself included."""

    slot_mapping: jax.Array  # [N] flat page slot page*page_size+offset of each token's new K/V
    block_tables: jax.Array  # [R, P] each row's pages in sequence order
    seq_lens: jax.Array  # [R] valid keys of the row once this step's K/V are written
    query_start_loc: jax.Array  # [R + 1] where each row's tokens start in the flat array
    positions: jax.Array  # [N] each token's position in its sequence


# -- the quantized KV cache ------------------------------------------------------------------

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8")
# kv_cache_dtype -> page element type (None: the model's dtype). "bfloat16" pages carry no scales
# (a float cache in half float32's bytes, written by a cast); the 8-bit ones do.
KV_PAGE_DTYPES = {
    "auto": None,
    "float32": jnp.float32,
    "bfloat16": jnp.uint16,
    "int8": jnp.int8,
    "fp8": jnp.float8_e4m3fn,
}
SCALED_KV_DTYPES = ("int8", "fp8")
# A "bfloat16" pool holds bfloat16 bit patterns in uint16 pages: XLA:CPU has no bfloat16 scatter
# and rewrites one into a float32 conversion of the whole pool and back (38 ms for a 1 GiB pool,
# every layer of every step, against microseconds for the uint16 scatter). Readers reinterpret
# the bits (`read_pages`; the native kernel takes uint16 pages as bfloat16).
BF16_BITS = jnp.dtype(jnp.uint16)


def as_bf16(pages):
    """uint16 pages (bfloat16 bits) as bfloat16; any other pages as they are."""
    return jax.lax.bitcast_convert_type(pages, jnp.bfloat16) if pages.dtype == BF16_BITS else pages


# the largest magnitude a page element holds: a token-head's max |x| maps to it
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# an 8-bit cache's per-token-per-head scales: 2 bytes, float32's exponent range (quantize_kv)
SCALE_DTYPE = jnp.bfloat16


def is_quantized(cache) -> bool:
    """A layer's cache tuple with scales beside the pages."""
    return len(cache) == 4


def quantize_kv(x, dtype):
    """Symmetric per-token-per-head quantization of x [..., D] -> (q [..., D] of dtype,
    scale [...] bfloat16), dequantized as q * float32(scale).

    scale = bfloat16(max|x| * float32(1/qmax)), rounded to nearest even (qmax 127 for int8,
    448 for float8_e4m3fn); then q = x * (1/float32(scale)), clipped to [-qmax, qmax] and
    rounded to nearest even (int8; float8's cast rounds), computed from the *stored* scale
    so that q * scale is what every reader gets. bfloat16, not float32, because the scale
    is 2 bytes beside D one-byte values instead of 4 (int8 holds 2D / (D + 2) times a
    bfloat16 cache's tokens, not 2D / (D + 4)); bfloat16, not float16, because it keeps
    float32's exponent range (float16 would round the scale of a head whose values are all
    near 1e-6 to zero). Rounding the scale down (by at most 2^-8 of it) can put |x| / scale
    up to qmax / (1 - 2^-8): the clip takes it back to qmax, an error of at most 2^-8 of
    max|x| (int8: 127 / (1 - 2^-8) < 127.5 rounds to 127 anyway, so every element stays
    within half a step).

    Values below float32's smallest normal count as zero, and so does a scale that would be
    below it (max|x| < qmax * 2^-126): XLA on the CPU flushes such denormals anyway, so
    saying it explicitly keeps every backend and the NumPy reference in agreement, and the
    reciprocal of a nonzero scale is always finite. A vector of zeros gets scale 0 and q 0.
    The bfloat16 rounding is ``lax.reduce_precision`` (a float32 -> bfloat16 -> float32
    round trip may be dropped by XLA under excess precision), and the multiply by a
    reciprocal is deliberate: XLA rewrites a division by a broadcast value that way, so
    spelling it out keeps the bytes identical to the NumPy reference (tests/test_kv_quant.py)."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    x32 = x.astype(jnp.float32)
    x32 = jnp.where(jnp.abs(x32) < tiny, jnp.float32(0), x32)  # (NaN stays NaN)
    raw = jnp.max(jnp.abs(x32), axis=-1) * jnp.float32(1.0 / qmax)
    raw = jnp.where(raw < tiny, jnp.float32(0), raw)
    scale = jax.lax.reduce_precision(raw, exponent_bits=8, mantissa_bits=7)  # bfloat16's, exactly
    inv = jnp.where(scale > 0, jnp.float32(1.0) / jnp.where(scale > 0, scale, 1.0), 0.0)
    y = jnp.clip(x32 * inv[..., None], -qmax, qmax)
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale.astype(SCALE_DTYPE)


def dequantize(pages, scales):
    """pages [..., D] (int8 / float8) x scales [...] (bfloat16) -> float32 [..., D]."""
    return pages.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]


def read_pages(pages, scales, idx):
    """pages[idx] as float32 (dequantized where scales is not None; bfloat16 bits
    reinterpreted); idx indexes the page axis."""
    if scales is None:
        return as_bf16(pages[idx])
    return dequantize(pages[idx], scales[idx])


# -- a pool of every layer's pages in one set of arrays ---------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolLayer:
    """One layer of a stacked pool: `arrays` hold every layer's pages one layer after another
    ([L * P, page_size, KVH, D], scales likewise), this layer's page p at `first_page + p`.
    Block tables and slot mappings keep the layer's own page ids (the same for every layer);
    `write_kv` and the attention backends add the offset.

    Why: a jitted step's call costs the host time per array it takes and returns (the pool is
    donated and comes back), so a pool of two arrays instead of two a layer takes 62 fewer
    arguments and 62 fewer outputs a step on a 32-layer model. A static offset into the one
    buffer, unlike a slice of a stacked [L, P, ...] array, costs no copy on any backend."""

    arrays: tuple
    first_page: int = dataclasses.field(metadata=dict(static=True))


def pool_layer(pool, layer: int, num_layers: int):
    """Layer `layer`'s cache in a model's pool: `pool[layer]` where the pool is one cache tuple
    a layer, a `PoolLayer` where it is one stacked tuple of every layer's pages (length 1)."""
    if len(pool) == num_layers:
        return pool[layer]
    (arrays,) = pool
    return PoolLayer(tuple(arrays), layer * (arrays[0].shape[0] // num_layers))


def pool_with_layer(pool, layer: int, cache):
    """The pool with layer `layer`'s cache replaced by `cache` (what its write returned)."""
    if isinstance(cache, PoolLayer):
        return (cache.arrays,)
    return (*pool[:layer], cache, *pool[layer + 1 :])


def stacked_pool(layers, num_layers: int):
    """A pool of `num_layers` layers in one cache tuple of stacked arrays, from `layers`, a
    function that makes one layer's zeroed cache tuple of pages [P, ...]."""
    one = layers()
    return (tuple(jnp.zeros((num_layers * x.shape[0], *x.shape[1:]), x.dtype) for x in one),)


def page_offset(cache) -> int:
    """Where a layer's page 0 sits in the arrays its cache holds (0 but in a stacked pool)."""
    return cache.first_page if isinstance(cache, PoolLayer) else 0


def split_cache(kv_pages):
    """(k_pages, v_pages, k_scales, v_scales) of a layer's cache tuple; scales None if unquantized.
    For a `PoolLayer`, the stacked arrays (its pages at `page_offset`)."""
    if isinstance(kv_pages, PoolLayer):
        return split_cache(kv_pages.arrays)
    if is_quantized(kv_pages):
        return tuple(kv_pages)
    k_pages, v_pages = kv_pages
    return k_pages, v_pages, None, None


def empty_kv_cache(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, kv_cache_dtype: str = "auto"):
    """One layer's zeroed cache tuple: (k, v) pages of dtype, or for "int8"/"fp8" 8-bit pages
    plus bfloat16 scales [num_pages, page_size, KVH]."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    page_dtype = KV_PAGE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype not in SCALED_KV_DTYPES:
        page_dtype = page_dtype or dtype
        return jnp.zeros(shape, page_dtype), jnp.zeros(shape, page_dtype)
    scales = shape[:3]
    return (
        jnp.zeros(shape, page_dtype),
        jnp.zeros(shape, page_dtype),
        jnp.zeros(scales, SCALE_DTYPE),
        jnp.zeros(scales, SCALE_DTYPE),
    )


def write_kv(cache, k, v, slot_mapping):
    """Write this step's k/v [B, T, KVH, D] into a layer's cache tuple at flat slots [B, T].

    Returns (new cache tuple, k, v as the pool now holds them). Unquantized, those are k and
    v (rounded to the pages' dtype: a bfloat16 pool under float32 activations); quantized, the 8-bit values and their scales are written and k/v come back
    dequantized (in k's dtype), so a fresh prompt attending to its own k/v ("prefill") sees
    exactly the values a later chunk or decode step reads from the pages: a prompt's result
    does not depend on whether its prefix came from the prefix cache or where a chunk
    boundary fell. A `PoolLayer` writes at its layer's pages and comes back as one."""
    if isinstance(cache, PoolLayer):
        ps = cache.arrays[0].shape[1]
        arrays, k, v = write_kv(cache.arrays, k, v, slot_mapping + cache.first_page * ps)
        return PoolLayer(arrays, cache.first_page), k, v
    if not is_quantized(cache):  # float pages (a "bfloat16" pool: its bits, see BF16_BITS)
        if cache[0].dtype == BF16_BITS:
            kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
            bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (kb, vb)]
            new = tuple(write_pages(c, b, slot_mapping) for c, b in zip(cache, bits))
            return new, kb.astype(k.dtype), vb.astype(v.dtype)
        return (write_pages(cache[0], k, slot_mapping), write_pages(cache[1], v, slot_mapping)), k, v
    k_pages, v_pages, k_scales, v_scales = cache
    qk, sk = quantize_kv(k, k_pages.dtype)
    qv, sv = quantize_kv(v, v_pages.dtype)
    new = (
        write_pages(k_pages, qk, slot_mapping),
        write_pages(v_pages, qv, slot_mapping),
        write_pages(k_scales, sk, slot_mapping),
        write_pages(v_scales, sv, slot_mapping),
    )
    return new, dequantize(qk, sk).astype(k.dtype), dequantize(qv, sv).astype(v.dtype)


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


def window_start(positions, sliding_window: int | None):
    """The first key position each query sees under a sliding window of W keys (transformers'
    `kv_idx > q_idx - W`: the query's own position and the W - 1 before it); 0 without one (a
    window of 0 or None is full attention)."""
    if not sliding_window:
        return jnp.zeros_like(positions)
    return jnp.maximum(positions - (sliding_window - 1), 0)


def causal_attention(q, k, v, scale: float, segment_ids=None, sliding_window: int | None = None):
    """Dense causal attention over a right-padded batch (no cache): training, parity tests and
    fresh prompts. segment_ids [B, T] packs several prompts in one row: a token sees only
    earlier tokens of its own segment. sliding_window W: a token sees only the W positions
    ending at its own (None or 0: all earlier ones)."""
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    if sliding_window:
        causal = causal & ~jnp.tril(jnp.ones((t, t), dtype=bool), -sliding_window)
    mask = jnp.broadcast_to(causal[None], (q.shape[0], t, t))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return _grouped_softmax_attention(q, k, v, mask, scale)


def gather_pages(pages, block_tables):
    """[num_pages, ps, KVH, D] x [B, P] -> [B, P*ps, KVH, D]: a slot's context in sequence order
    (scales [num_pages, ps, KVH] -> [B, P*ps, KVH] likewise)."""
    g = pages[block_tables]
    b, p, ps = g.shape[:3]
    return g.reshape(b, p * ps, *g.shape[3:])


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    positions,
    scale: float,
    k_scales=None,
    v_scales=None,
    sliding_window: int | None = None,
):
    """Attention of q [B,T,H,D] (token t of slot b at positions[b,t]) over the slot's pages.

    Key j of slot b is visible iff j < context_lens[b] and j <= positions[b, t]. This one
    function serves decode (T=1), chunked prefill and prefill after a prefix-cache hit.
    With k_scales/v_scales [num_pages, page_size, KVH] the pages are quantized: dequantized
    after the gather, attention in float32. sliding_window W (None or 0: none) also hides key j
    when j < positions[b, t] - W + 1 (``window_start``).
    """
    out_dtype = q.dtype
    k = as_bf16(gather_pages(k_pages, block_tables))
    v = as_bf16(gather_pages(v_pages, block_tables))
    if k.dtype != q.dtype and k_scales is None:  # bfloat16 pages under float32 queries
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    if k_scales is not None:
        k = dequantize(k, gather_pages(k_scales, block_tables))
        v = dequantize(v, gather_pages(v_scales, block_tables))
        q = q.astype(jnp.float32)
    j = jnp.arange(k.shape[1])
    mask = (j[None, None, :] < context_lens[:, None, None]) & (j[None, None, :] <= positions[:, :, None])
    mask = mask & (j[None, None, :] >= window_start(positions, sliding_window)[:, :, None])
    return _grouped_softmax_attention(q, k, v, mask, scale).astype(out_dtype)


def write_pages(pages, new, slot_mapping):
    """Scatter new [B,T,KVH,D] into pages at flat slots page*page_size+offset ([B,T]) (scales:
    new [B,T,KVH] into [num_pages, ps, KVH] likewise)."""
    n, ps = pages.shape[:2]
    rest = pages.shape[2:]
    slots, new = slot_mapping.reshape(-1), new.reshape(-1, *rest).astype(pages.dtype)
    if slots.shape[0] == 1:
        # One token (a batch-1 decode step): XLA rewrites a one-index scatter into a bounds-checked
        # dynamic-update-slice of the flat view, and on the CPU that write was made twice, once
        # for each shape its users read (the attention's [P, ps, ...] and the next layer's flat
        # view), each into a whole copy of the pool (a 1-row step of a 64 MiB pool took ~90 ms, of
        # two rows 0.5 ms). One dynamic-update-slice of the pages' own shape writes in place; a
        # slot is always in range (padding writes the dummy page). More tokens stay one scatter of
        # the flat view: a scatter indexed by (page, offset) writes in place too, but took 1.8x
        # as long at 2,048 tokens.
        zeros = (0,) * len(rest)
        return jax.lax.dynamic_update_slice(pages, new[None], (slots[0] // ps, slots[0] % ps, *zeros))
    return pages.reshape(n * ps, *rest).at[slots].set(new).reshape(pages.shape)


def paged_attention_chunked(
    q,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    positions,
    scale: float,
    pages_per_chunk: int = 2,
    k_scales=None,
    v_scales=None,
    sliding_window: int | None = None,
):
    """Paged attention as a loop over chunks of pages with an online softmax: flash-decoding
    in plain XLA. Same semantics as paged_attention (key j visible iff j < context_lens[b]
    and j <= positions[b, t]) but it never materialises a slot's whole context: on the CPU
    that is several times faster (XLA's gather of a large [B, S] context is slow, and the
    loop's working set stays in cache), and the trip count follows the longest live context,
    so one compiled step serves every length.

    q [B, T, H, D]; block_tables [B, P] with P a multiple of pages_per_chunk; -> [B, T, H, D].
    Quantized pages (k_scales/v_scales given) are dequantized chunk by chunk. sliding_window W
    (None or 0: none) hides keys before ``window_start``; the loop starts at the first chunk
    any query sees, so a windowed layer reads about W keys per token, not its whole context.
    """
    b, t, h, d = q.shape
    _, ps, kvh, _ = k_pages.shape
    g = h // kvh
    c = pages_per_chunk
    span = c * ps
    qg = (q.astype(jnp.float32) * scale).reshape(b, t, kvh, g, d)
    n_chunks = (jnp.max(context_lens) + span - 1) // span
    limit = jnp.minimum(context_lens[:, None], positions + 1)  # [B, T]: keys j < limit are visible
    start = window_start(positions, sliding_window)  # [B, T]: and keys j >= start
    live = limit > start
    first_chunk = 0
    if sliding_window:  # chunks wholly before every live query's window are skipped
        first_chunk = jnp.minimum(jnp.min(jnp.where(live, start, jnp.iinfo(start.dtype).max)) // span, n_chunks)

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(block_tables, i * c, c, axis=1)
        k = read_pages(k_pages, k_scales, pages).reshape(b, span, kvh, d).astype(jnp.float32)
        v = read_pages(v_pages, v_scales, pages).reshape(b, span, kvh, d).astype(jnp.float32)
        s = jnp.einsum("btkgd,bskd->btkgs", qg, k)
        pos = i * span + jnp.arange(span)
        seen = (pos[None, None, :] < limit[:, :, None]) & (pos[None, None, :] >= start[:, :, None])  # [B, T, span]
        seen = seen[:, :, None, None, :]
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        # exactly zero for hidden keys, also in a chunk before the window where a query has
        # seen nothing yet (exp(_NEG - _NEG) would be 1)
        p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum("btkgs,bskd->btkgd", p, v)

    init = (
        jnp.full((b, t, kvh, g), _NEG, jnp.float32),
        jnp.zeros((b, t, kvh, g), jnp.float32),
        jnp.zeros((b, t, kvh, g, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first_chunk, n_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(b, t, h, d).astype(q.dtype)


# -- ragged batches: one flat token array, rows of any query length ---------------------------


def token_rows(query_start_loc, num_tokens: int):
    """[N] the row of each flat token (query_start_loc [R+1]); tokens at or past
    query_start_loc[R] (padding) get R - 1 and are masked by ``ragged_valid``."""
    r = query_start_loc.shape[0] - 1
    rows = jnp.searchsorted(query_start_loc, jnp.arange(num_tokens, dtype=query_start_loc.dtype), side="right") - 1
    return jnp.clip(rows, 0, r - 1)


def ragged_valid(query_start_loc, num_tokens: int):
    """[N] bool: the token belongs to a row (it is not padding past query_start_loc[R])."""
    return jnp.arange(num_tokens) < query_start_loc[-1]


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    query_start_loc,
    seq_lens,
    block_tables,
    positions,
    scale: float,
    k_scales=None,
    v_scales=None,
    *,
    sliding_window: int | None = None,
):
    """The oracle of every ragged attention kernel.

    q [N, H, D] is one flat array of query tokens; row r owns tokens
    [query_start_loc[r], query_start_loc[r + 1]) (query_start_loc [R+1], nondecreasing, from 0)
    and reads its keys through block_tables[r] [P]. Token n of row r sees key j iff
    j < seq_lens[r] and j <= positions[n]. A token that sees nothing, and every token at or past
    query_start_loc[R] (padding), gets zeros. Decode rows have one token, prefill chunks many,
    speculative verification k + 1: one call serves them all. sliding_window W (a layer's;
    None or 0: full attention) also hides key j when j < positions[n] - W + 1.

    Gathers every token's whole context (``paged_attention`` with one row per token): memory
    N x P x page_size, an oracle, not a serving path."""
    n = q.shape[0]
    rows = token_rows(query_start_loc, n)
    valid = ragged_valid(query_start_loc, n)
    lens = jnp.where(valid, seq_lens[rows], 0)
    out = paged_attention(
        q[:, None],
        k_pages,
        v_pages,
        block_tables[rows],
        lens,
        positions[:, None],
        scale,
        k_scales,
        v_scales,
        sliding_window,
    )[:, 0]
    sees = jnp.minimum(lens, positions + 1) > 0
    return jnp.where(sees[:, None, None], out, jnp.zeros_like(out))


def ragged_paged_attention_chunked(
    q,
    k_pages,
    v_pages,
    query_start_loc,
    seq_lens,
    block_tables,
    positions,
    scale: float,
    k_scales=None,
    v_scales=None,
    *,
    pages_per_chunk: int = 2,
    sliding_window: int | None = None,
):
    """The XLA serving path of a ragged step, with ``ragged_paged_attention``'s arguments and
    result: ``paged_attention_chunked`` with one row per token (its row's block table and
    length), so one compiled loop serves decode, chunks and verification alike; its trip count
    follows the longest live context. Every token re-reads its row's pages: right for decode
    rows, N-fold work for a long chunk (the native and Pallas kernels share them)."""
    n = q.shape[0]
    rows = token_rows(query_start_loc, n)
    lens = jnp.where(ragged_valid(query_start_loc, n), seq_lens[rows], 0)
    tables = block_tables[rows]
    pad = (-tables.shape[1]) % pages_per_chunk
    if pad:
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    out = paged_attention_chunked(
        q[:, None],
        k_pages,
        v_pages,
        tables,
        lens,
        positions[:, None],
        scale,
        pages_per_chunk,
        k_scales,
        v_scales,
        sliding_window,
    )[:, 0]
    sees = jnp.minimum(lens, positions + 1) > 0  # padding and tokens that see nothing: zeros
    return jnp.where(sees[:, None, None], out, jnp.zeros_like(out))
