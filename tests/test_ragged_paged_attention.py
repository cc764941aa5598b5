"""The ragged paged attention kernel (both lowerings, interpret mode on the CPU; the Triton
lowering compiled under JAX_PLATFORMS=cuda) against the jnp
oracle ``reference.ragged_paged_attention``: one flat token array mixing decode rows, prefill
chunks (up to 256 tokens) and speculative-verify rows, empty rows and padding tokens,
contexts 1..2048, grouped-query ratios 1/2/4/8, head dims 32/64/128, page sizes 8/16/32,
float32 / bfloat16 / int8 pages. Pages outside every live context (unused pages, the dummy
page 0 that pads block tables, the tail of each last page) hold NaN (int8: NaN scales) and
must not reach the result. The compiled lowerings (Mosaic, Triton) are checked to lower
without a device.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_pools import close, page_pool, randn

from jaxserve.runner.attention import paged_forward
from pallas_kernels import reference
from pallas_kernels.lowering import default_backend
from pallas_kernels.ragged_paged_attention import plan_work_items, ragged_paged_attention

# interpret=None: each lowering compiles where its platform runs it natively (Triton under
# JAX_PLATFORMS=cuda) and is interpreted elsewhere. On a GPU the TPU lowering would only be
# interpreted again, so that run checks the Triton kernel alone.
BACKENDS = ["gpu"] if jax.default_backend() == "gpu" else ["tpu", "gpu"]
_oracle = jax.jit(reference.ragged_paged_attention, static_argnums=7, static_argnames="sliding_window")


def attention(q, k, v, kv_pages, md, *, scale, **knobs):
    """The engine's `pallas` attention backend (runner/attention.py: paged_forward) over this
    kernel, with `knobs` passed to it."""
    return paged_forward(functools.partial(ragged_paged_attention, **knobs))(q, k, v, kv_pages, md, scale=scale)


@dataclasses.dataclass
class RaggedMeta:
    """The four fields the backend's forward reads (the engine's metadata class has more)."""

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    positions: jax.Array


def ragged_batch(rng, qlens, ctxs, pad, ps, kvh, ratio, d, dtype, shuffle_positions=False):
    """A flat batch: row r has qlens[r] new tokens at the end of a context of ctxs[r] keys,
    then `pad` padding tokens. Returns (q, clean k, clean v, poisoned k, poisoned v, meta)."""
    k, v, kb, vb, bt = page_pool(rng, ctxs, ps, kvh, d, dtype)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    n = int(qsl[-1]) + pad
    pos = np.full(n, 7, np.int32)  # padding tokens: any position, they must still get zeros
    for r, (t, c) in enumerate(zip(qlens, ctxs)):
        p = c - t + np.arange(t)
        pos[qsl[r] : qsl[r + 1]] = rng.permutation(p) if shuffle_positions else p
    q = randn(rng, (n, kvh * ratio, d), dtype)
    meta = RaggedMeta(jnp.asarray(qsl), jnp.asarray(ctxs, jnp.int32), bt, jnp.asarray(pos))
    return q, k, v, kb, vb, meta


def _args(meta):
    return meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.positions


@st.composite
def rows(draw, max_rows=4, max_tokens=300, max_context=2048):
    """Per-row (query length, context): decode (1), verify (2..6), chunks (7..256), empty
    rows (0 tokens, maybe 0 context); contexts at least the query length, up to max_context."""
    r = draw(st.integers(1, max_rows))
    qlens, ctxs = [], []
    budget = max_tokens
    for _ in range(r):
        kind = draw(st.sampled_from(["decode", "verify", "chunk", "empty"]))
        t = {"decode": 1, "verify": draw(st.integers(2, 6)), "chunk": draw(st.integers(7, 256)), "empty": 0}[kind]
        t = min(t, budget)
        budget -= t
        lo = 0 if t == 0 else t
        c = draw(st.integers(lo, max_context)) if draw(st.booleans()) else draw(st.integers(lo, lo + 40))
        qlens.append(t)
        ctxs.append(c)
    return qlens, ctxs


@settings(max_examples=4, deadline=None)
@given(
    data=st.data(),
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    kvh=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 4, 8]),
    d=st.sampled_from([32, 64, 128]),
    ps=st.sampled_from([8, 16, 32]),
    pad=st.integers(0, 9),
    shuffle=st.booleans(),
)
def test_matches_oracle(data, backend, dtype, kvh, ratio, d, ps, pad, shuffle):
    qlens, ctxs = data.draw(rows(), label="qlens, contexts")
    if backend == "tpu":
        knobs = dict(
            block_q=data.draw(st.sampled_from([None, 1, 8, 64]), label="block_q"),
            pages_per_block=data.draw(st.sampled_from([None, 1, 3]), label="pages_per_block"),
            kv_heads_per_block=data.draw(st.sampled_from([None, kvh]), label="kv_heads_per_block"),
        )
    else:
        knobs = dict(
            block_q=data.draw(st.sampled_from([None, 1, 32]), label="block_q"),
            pages_per_block=data.draw(st.sampled_from([None, 1, 4]), label="pages_per_block"),
            num_splits=data.draw(st.sampled_from([None, 1, 3]), label="num_splits"),
        )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    q, k, v, kb, vb, meta = ragged_batch(rng, qlens, ctxs, pad, ps, kvh, ratio, d, dtype, shuffle)
    scale = 1 / math.sqrt(d)
    want = _oracle(q, k, v, *_args(meta), scale)
    got = ragged_paged_attention(q, kb, vb, *_args(meta), scale, backend=backend, interpret=None, **knobs)
    assert got.shape == q.shape and got.dtype == q.dtype
    close(got, want, dtype)
    n_live = int(meta.query_start_loc[-1])
    assert (np.asarray(got[n_live:], np.float32) == 0).all()  # padding tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_step_long_contexts(backend):
    """One engine-like step: a 256-token prefill chunk deep in a 2048-key context, a fresh
    prompt, decode rows, a speculative verify row (k + 1 = 5), an empty slot, and padding."""
    rng = np.random.default_rng(11)
    qlens = [1, 256, 5, 0, 1, 40, 1]
    ctxs = [2048, 1500, 733, 0, 1, 40, 129]
    q, k, v, kb, vb, meta = ragged_batch(rng, qlens, ctxs, 12, 16, 1, 8, 64, jnp.bfloat16)
    want = _oracle(q, k, v, *_args(meta), 0.125)
    got = ragged_paged_attention(q, kb, vb, *_args(meta), 0.125, backend=backend, interpret=None)
    close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 7, 64])
def test_gpu_split_k(num_splits):
    """The Triton lowering's split-K (interpreted on the CPU): decode rows over long contexts,
    a verify row, a short row whose keys end inside the first split, and an empty row. Splits
    past an item's last key see nothing and must weigh nothing in the merge."""
    rng = np.random.default_rng(21)
    qlens, ctxs = [1, 1, 5, 1, 0], [2000, 700, 1300, 9, 0]
    q, k, v, kb, vb, meta = ragged_batch(rng, qlens, ctxs, 3, 16, 2, 4, 64, jnp.float32)
    want = _oracle(q, k, v, *_args(meta), 0.125)
    got = ragged_paged_attention(
        q, kb, vb, *_args(meta), 0.125, backend="gpu", interpret=True, pages_per_block=2, num_splits=num_splits
    )
    close(got, want, jnp.float32)


def test_gpu_splits_policy():
    """Split-K where few programs walk long contexts; none for a mixed step's many items or
    where the float32 partials would grow large; never more splits than page blocks."""
    from pallas_kernels.ragged_paged_attention import gpu_splits

    assert gpu_splits(1, 8, 16 * 128, blocks=64, num_splits=None) == 33  # batch-1 decode: 264 programs
    assert gpu_splits(16, 8, 64 * 128, blocks=64, num_splits=None) == 3
    assert gpu_splits(34, 8, 64 * 128, blocks=64, num_splits=None) == 1  # 16 rows + a 256-token chunk
    assert gpu_splits(1, 8, 16 * 128, blocks=4, num_splits=None) == 4
    assert gpu_splits(2, 1, (1 << 20) - 2, blocks=64, num_splits=None) == 2  # 8 MiB of partials a split
    assert gpu_splits(1, 8, 16 * 128, blocks=64, num_splits=5) == 5


def test_gpu_long_item_splits_policy():
    """A step with many items still splits its long items: the H200's mixed step (16 decode
    rows at 4,096 keys + a 256-token chunk: 34 items x 8 KV heads) gets 7 splits where
    gpu_splits gives 1; none for tables too narrow to split; the partials' bytes cap it."""
    from pallas_kernels.ragged_paged_attention import MIN_BLOCKS_PER_SPLIT, gpu_long_item_splits

    assert gpu_long_item_splits(34, 8, 64 * 128, blocks=64) == 7  # 64 MiB / 9.1 MB a split
    assert gpu_long_item_splits(4, 2, 16 * 64, blocks=64) == 8  # at most MAX_LONG_ITEM_SPLITS
    assert gpu_long_item_splits(4, 2, 16 * 64, blocks=2 * MIN_BLOCKS_PER_SPLIT) == 2
    assert gpu_long_item_splits(4, 2, 16 * 64, blocks=MIN_BLOCKS_PER_SPLIT - 1) == 1
    assert gpu_long_item_splits(512, 8, 64 * 128, blocks=64) == 1


def test_gpu_mixed_step_splits_long_items(monkeypatch):
    """A mixed step past the programs target (here a target of 1, so gpu_splits gives 1) takes
    the long-item splits: decode rows over long contexts, a chunk, a verify row, an empty row
    and padding, each item spreading its own page blocks over the splits, against the oracle;
    the merge of the partials runs (the split path was taken)."""
    import pallas_kernels.ragged_paged_attention as rpa

    monkeypatch.setattr(rpa, "GPU_TARGET_PROGRAMS", 1)
    merged = []
    real = rpa.combine_splits
    monkeypatch.setattr(rpa, "combine_splits", lambda acc, *a: merged.append(acc.shape[0]) or real(acc, *a))
    rng = np.random.default_rng(8)
    qlens, ctxs = [1, 40, 1, 4, 0, 1], [1900, 40, 600, 700, 0, 33]
    q, k, v, kb, vb, meta = ragged_batch(rng, qlens, ctxs, 5, 16, 2, 2, 64, jnp.float32)
    want = _oracle(q, k, v, *_args(meta), 0.125)
    got = ragged_paged_attention(q, kb, vb, *_args(meta), 0.125, backend="gpu", interpret=True, pages_per_block=2)
    close(got, want, jnp.float32)
    assert merged and merged[0] == 8  # 1,900 keys at 2 pages a block: 60 blocks, 8 splits


def test_gpu_windowed_split_k():
    """Split-K over a windowed layer: each item's splits cover its blocks from its first
    visible one (the window's), not from key 0."""
    rng = np.random.default_rng(9)
    qlens, ctxs = [1, 3, 1], [1500, 800, 90]
    q, k, v, kb, vb, meta = ragged_batch(rng, qlens, ctxs, 2, 16, 2, 4, 64, jnp.float32)
    want = _oracle(q, k, v, *_args(meta), 0.125, sliding_window=300)
    got = ragged_paged_attention(
        q, kb, vb, *_args(meta), 0.125, backend="gpu", interpret=True, num_splits=4, sliding_window=300
    )
    close(got, want, jnp.float32)


def _quantized(rng, qlens, ctxs, ps, kvh, ratio, d, kind):
    """An 8-bit pool (reference.quantize_kv) with NaN scales wherever no live context reaches:
    (q, clean cache tuple, poisoned cache tuple, meta)."""
    q, k, v, kb, _, meta = ragged_batch(rng, qlens, ctxs, 3, ps, kvh, ratio, d, jnp.float32)
    dead = jnp.isnan(kb[..., 0])
    (qk, sk), (qv, sv) = reference.quantize_kv(k, kind), reference.quantize_kv(v, kind)
    bad = tuple(jnp.where(dead, jnp.nan, s).astype(s.dtype) for s in (sk, sv))
    return q, (qk, qv, sk, sv), (qk, qv, *bad), meta


@pytest.mark.parametrize(
    "backend,kind,ps,ratio,knobs",
    [
        ("tpu", jnp.int8, 16, 4, {}),
        ("tpu", jnp.int8, 8, 2, {"kv_heads_per_block": 2, "pages_per_block": 3}),
        ("gpu", jnp.int8, 8, 8, {"pages_per_block": 2}),
        ("gpu", jnp.float8_e4m3fn, 32, 1, {}),
    ],
)
def test_quantized_pages(backend, kind, ps, ratio, knobs):
    """8-bit pages are widened and scaled per token in the kernel; the oracle dequantizes the
    same bytes. NaN scales in dead slots stay out."""
    rng = np.random.default_rng(ps + ratio)
    q, clean, bad, meta = _quantized(rng, [3, 1, 70, 0], [90, 17, 200, 0], ps, 2, ratio, 64, kind)
    want = _oracle(q, clean[0], clean[1], *_args(meta), 0.125, clean[2], clean[3])
    got = ragged_paged_attention(
        q, bad[0], bad[1], *_args(meta), 0.125, bad[2], bad[3], backend=backend, interpret=None, **knobs
    )
    close(got, want, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_to_see_gives_zeros(backend):
    """Only padding (query_start_loc all 0), and rows whose tokens see no key (context 0 or a
    negative position), all give zeros without reading a page."""
    rng = np.random.default_rng(5)
    k, v, kb, vb, bt = page_pool(rng, [16, 16], 8, 1, 32, jnp.float32)
    q = randn(rng, (6, 2, 32))
    kw = dict(backend=backend, interpret=None)
    out = ragged_paged_attention(
        q, kb, vb, jnp.zeros(3, jnp.int32), jnp.asarray([16, 16], jnp.int32), bt, jnp.arange(6), 0.1, **kw
    )
    assert (np.asarray(out) == 0).all()
    qsl, sl = jnp.asarray([0, 2, 5], jnp.int32), jnp.asarray([0, 16], jnp.int32)
    pos = jnp.asarray([0, 1, -1, -5, 3, 0], jnp.int32)
    out = np.asarray(ragged_paged_attention(q, kb, vb, qsl, sl, bt, pos, 0.1, **kw))
    want = np.asarray(_oracle(q, k, v, qsl, sl, bt, pos, 0.1))
    assert (out[[0, 1, 2, 3, 5]] == 0).all()
    close(out, want, jnp.float32)


_plan = jax.jit(plan_work_items, static_argnames=("num_tokens", "block_q", "max_keys"))


@settings(max_examples=30, deadline=None)
@given(
    qlens=st.lists(st.integers(0, 70), min_size=6, max_size=6),
    bq=st.sampled_from([8, 16, 32]),
)
def test_work_items_cover_every_token_once(qlens, bq):
    """The plan: every live token sits in exactly one slot of one item, items never straddle
    rows, the static item count is enough, and a slot's limit is its token's limit. (One
    token count, 6 rows of which any may be empty: one compile per block size.)"""
    n = 6 * 70 + 5  # the rest is padding
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    ctx = np.asarray(qlens, np.int32) + 3
    pos = np.arange(n, dtype=np.int32) % 11
    it = _plan(jnp.asarray(qsl), jnp.asarray(ctx), jnp.asarray(pos), num_tokens=n, block_q=bq, max_keys=64)
    it = jax.tree.map(np.asarray, it)
    rows = np.clip(np.searchsorted(qsl, np.arange(n), side="right") - 1, 0, 5)
    live = np.arange(n) < qsl[-1]
    tok_limit = np.where(live, np.minimum(ctx[rows], pos + 1), 0)
    used = it.limit > 0  # [W, bq]: the slots that hold a token that sees something
    tok = it.token[used]
    assert np.bincount(tok, minlength=n).tolist() == (tok_limit > 0).astype(int).tolist()
    assert (rows[tok] == np.broadcast_to(it.row[:, None], used.shape)[used]).all()
    assert (it.limit[used] == tok_limit[tok]).all()
    w_idx, s_idx = np.nonzero(used)
    assert (it.token_item[tok] == w_idx).all() and (it.token_slot[tok] == s_idx).all()
    assert (it.valid == live).all()
    assert (it.bound == it.limit.max(axis=1)).all()


_plan_windowed = jax.jit(plan_work_items, static_argnames=("num_tokens", "block_q", "max_keys", "sliding_window"))


@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 300)), min_size=5, max_size=5),
    bq=st.sampled_from([1, 16, 64]),
    span=st.sampled_from([16, 64]),
    window=st.sampled_from([None, 40]),
)
def test_whole_blocks_are_visible_to_every_live_slot(rows, bq, span, window):
    """The GPU kernel runs the page blocks in [full_from, full_to) without masks: every key in
    them must be visible to every slot of the item that sees any key (past its window start,
    before its limit), and an item far from its diagonal must get such blocks."""
    from pallas_kernels.ragged_paged_attention import _whole_blocks

    qlens = [t for t, _ in rows]
    ctxs = [t + extra for t, extra in rows]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    n = 360  # static: 5 rows of at most 70 tokens, then padding
    pos = np.zeros(n, np.int32)
    for r, (t, c) in enumerate(zip(qlens, ctxs)):
        pos[qsl[r] : qsl[r + 1]] = c - t + np.arange(t)
    items = _plan_windowed(
        jnp.asarray(qsl), jnp.asarray(ctxs, jnp.int32), jnp.asarray(pos), num_tokens=n, block_q=bq,
        max_keys=1024, sliding_window=window,
    )  # fmt: skip
    lo, hi = (np.asarray(x) for x in jax.jit(_whole_blocks, static_argnums=1)(items, span))
    limit, start = np.asarray(items.limit), np.asarray(items.start)
    for w in range(limit.shape[0]):
        live = limit[w] > start[w]
        if hi[w] > lo[w]:
            assert live.any()
            assert (start[w][live] <= lo[w] * span).all() and (limit[w][live] >= hi[w] * span).all()
        if live.any() and window is None and limit[w][live].min() >= 2 * span:
            assert hi[w] > lo[w]  # a block wholly below the item's diagonal exists: it is used


@pytest.mark.parametrize("quantized", [False, True])
def test_attention_entry_point(quantized):
    """The backend's forward over this kernel reads the cache tuple and the duck-typed metadata;
    the lowering follows the platform: on the CPU the TPU one, interpreted; on a GPU Triton's
    (the kernel's name in the jaxpr)."""
    rng = np.random.default_rng(9)
    qlens, ctxs = [2, 1, 9], [30, 8, 9]
    if quantized:
        q, clean, bad, meta = _quantized(rng, qlens, ctxs, 8, 2, 2, 32, jnp.int8)
    else:
        q, k, v, kb, vb, meta = ragged_batch(rng, qlens, ctxs, 4, 8, 2, 2, 32, jnp.float32)
        clean, bad = (k, v), (kb, vb)
    want = _oracle(q, *clean[:2], *_args(meta), 0.2, *clean[2:])
    got = attention(q, None, None, bad, meta, scale=0.2)
    close(got, want, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda q, c: attention(q, None, None, c, meta, scale=0.2))(q, bad))
    assert f"ragged_paged_attention_{default_backend()}" in jaxpr


@pytest.mark.parametrize(
    "field,change",
    [
        ("positions", lambda a: a.update(positions=a["positions"][:-1])),
        ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"][:-1])),
        ("block_tables", lambda a: a.update(block_tables=a["block_tables"][:1])),
        ("query heads", lambda a: a.update(q=a["q"][:, :3])),
        ("v_scales", lambda a: a.update(k_scales=jnp.zeros(a["k_pages"].shape[:3], jnp.bfloat16))),
    ],
)
def test_bad_shapes_name_the_field(field, change):
    rng = np.random.default_rng(2)
    q, _, _, kb, vb, meta = ragged_batch(rng, [2, 1], [5, 9], 0, 8, 2, 2, 32, jnp.float32)
    a = dict(
        q=q,
        k_pages=kb,
        v_pages=vb,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        positions=meta.positions,
    )
    change(a)
    with pytest.raises(ValueError, match=field):
        ragged_paged_attention(**a, scale=0.1, interpret=True)


def export_for(platform: str, fn, *args):
    """Lower fn for a platform this machine does not have: runs the Pallas Mosaic/Triton
    lowering rules (block-shape legality, supported primitives) without compiling."""
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=skip)(*args)


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize(
    "d,ps,kvh,ratio,page_dtype",
    [(64, 8, 2, 4, None), (128, 16, 2, 2, None), (32, 16, 2, 8, None), (128, 32, 4, 1, jnp.int8)],
)
def test_compiled_lowerings(backend, platform, d, ps, kvh, ratio, page_dtype):
    """bfloat16 q over bfloat16 or int8 pages, through the backend's forward (default knobs),
    lowered for the device."""
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    n, r, num_pages, p = 200, 6, 50, 12
    quantized = page_dtype is not None
    pages = sd((num_pages, ps, kvh, d), page_dtype or bf)
    cache = (pages, pages) + ((sd((num_pages, ps, kvh), bf),) * 2 if quantized else ())

    def f(q, cache, qsl, sl, bt, pos):
        return attention(
            q, None, None, cache, RaggedMeta(qsl, sl, bt, pos), scale=0.1, interpret=False, backend=backend
        )

    exported = export_for(
        platform,
        f,
        sd((n, kvh * ratio, d), bf),
        cache,
        sd((r + 1,), i32),
        sd((r,), i32),
        sd((r, p), i32),
        sd((n,), i32),
    )
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in exported.mlir_module()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_compiled_lowering_split_k(num_splits):
    """A small decode batch over long contexts lowers to Triton with and without split-K (the
    partials and their merge outside the kernel)."""
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    pages = sd((300, 16, 8, 128), bf)

    def f(q, kp, vp, qsl, sl, bt, pos):
        return ragged_paged_attention(
            q, kp, vp, qsl, sl, bt, pos, 0.1, backend="gpu", interpret=False, num_splits=num_splits
        )

    args = (sd((2, 32, 128), bf), pages, pages, sd((3,), i32), sd((2,), i32), sd((2, 128), i32), sd((2,), i32))
    assert "triton" in export_for("cuda", f, *args).mlir_module()


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("block_q", [1, 3, 64])
def test_compiled_lowerings_block_q(backend, platform, block_q):
    """Small items (decode-heavy steps: G x block_q rows; Triton raises it to 16 rows) and
    large ones lower too."""
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    pages = sd((40, 16, 2, 64), bf)

    def f(q, kp, vp, qsl, sl, bt, pos):
        return ragged_paged_attention(
            q, kp, vp, qsl, sl, bt, pos, 0.1, backend=backend, interpret=False, block_q=block_q
        )

    args = (sd((64, 4, 64), bf), pages, pages, sd((5,), i32), sd((4,), i32), sd((4, 9), i32), sd((64,), i32))
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in export_for(platform, f, *args).mlir_module()


def test_compiled_lowering_mixed_step_splits():
    """A mixed step past the programs target (49 items x 8 KV heads over 4,096-key tables)
    lowers to Triton with the long-item splits its default takes (5 here)."""
    from pallas_kernels.ragged_paged_attention import gpu_long_item_splits

    assert gpu_long_item_splits(49, 8, 64 * 128, blocks=64) == 5
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    pages = sd((600, 16, 8, 128), bf)

    def f(q, kp, vp, qsl, sl, bt, pos):
        return ragged_paged_attention(q, kp, vp, qsl, sl, bt, pos, 0.1, backend="gpu", interpret=False)

    args = (sd((512, 32, 128), bf), pages, pages, sd((18,), i32), sd((17,), i32), sd((17, 256), i32), sd((512,), i32))
    assert "triton" in export_for("cuda", f, *args).mlir_module()
