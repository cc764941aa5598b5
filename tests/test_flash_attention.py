"""The flash attention kernel (both lowerings, interpret mode on the CPU) against the jnp
reference: packed prompts with segment ids, chunks at a query offset over padded keys,
grouped-query ratios 1/2/4, head dims 64/128 (and 16), lengths that are not multiples of the
tiles, float32 and bfloat16. Padded keys hold NaN and must not change the result. The
compiled lowerings (Mosaic for TPU, Triton for GPU) are checked to lower without a device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import reference
from pallas_kernels.flash_attention import flash_attention

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
BACKENDS = ["tpu", "gpu"]


def _randn(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _qkv(rng, b, tq, tk, kvh, ratio, d, dtype):
    return (
        _randn(rng, (b, tq, kvh * ratio, d), dtype),
        _randn(rng, (b, tk, kvh, d), dtype),
        _randn(rng, (b, tk, kvh, d), dtype),
    )


def _poison_tail(x, lens):
    """NaN in every key position at or beyond lens[b]."""
    j = jnp.arange(x.shape[1])
    return jnp.where((j[None, :] >= jnp.asarray(lens)[:, None])[:, :, None, None], jnp.nan, x)


def _reference_positions(q, k, v, kv_lens, positions, scale):
    """The oracle for offsets/lengths: reference.paged_attention over a trivial paging of the
    contiguous K/V (key j visible iff j < kv_lens[b] and j <= positions[b, t])."""
    b, tk, kvh, d = k.shape
    ps = 8
    p = -(-tk // ps)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, p * ps - tk), (0, 0), (0, 0))).reshape(b * p, ps, kvh, d)
    bt = jnp.arange(b * p, dtype=jnp.int32).reshape(b, p)
    return reference.paged_attention(
        q, pad(k), pad(v), bt, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(positions, jnp.int32), scale
    )


def _close(got, want, dtype):
    tol = TOL[dtype]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


shapes = dict(
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    b=st.integers(1, 3),
    kvh=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([64, 128]),
    block_q=st.sampled_from([32, 64, 128]),
    block_k=st.sampled_from([32, 64, 128]),
    all_heads=st.booleans(),  # TPU: every KV head in one grid step (the head_dim % 128 != 0 layout)
)


@settings(max_examples=9, deadline=None)
@given(data=st.data(), **shapes)
def test_packed_prefill_matches_reference(data, backend, dtype, b, kvh, ratio, d, block_q, block_k, all_heads):
    """Fresh prompts packed in one row (segment ids, -1 padding at the end), as the engine's
    prefill step sends them."""
    seg_lens = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=3), label="segments")
    n_pad = data.draw(st.integers(0, 37), label="padding")
    real = sum(seg_lens)
    t = real + n_pad
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    q, k, v = _qkv(rng, b, t, t, kvh, ratio, d, dtype)
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(seg_lens)] + [np.full(n_pad, -1)]).astype(np.int32)
    seg = jnp.asarray(np.broadcast_to(seg, (b, t)))
    scale = 1 / math.sqrt(d)
    kw = dict(
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        backend=backend,
        kv_heads_per_block=kvh if (all_heads and backend == "tpu") else None,
    )
    want = reference.causal_attention(q, k, v, scale, seg)
    # Exact reference semantics on every row, padding rows included.
    _close(flash_attention(q, k, v, segment_ids=seg, **kw), want, dtype)
    # With the padding declared as such (kv_lens), NaN there changes no real token.
    lens = jnp.full((b,), real, jnp.int32)
    got = flash_attention(q, _poison_tail(k, lens), _poison_tail(v, lens), segment_ids=seg, kv_lens=lens, **kw)
    _close(got[:, :real], want[:, :real], dtype)


@settings(max_examples=9, deadline=None)
@given(data=st.data(), **shapes)
def test_offset_chunk_over_padded_keys_matches_reference(
    data, backend, dtype, b, kvh, ratio, d, block_q, block_k, all_heads
):
    """A chunk of queries at a per-row start offset (chunked prefill / prefix-cache hit)
    over a right-padded batch of keys with per-row lengths; the padding holds NaN."""
    tq = data.draw(st.integers(1, 70), label="tq")
    tk = data.draw(st.integers(1, 600), label="tk")
    lens = np.asarray(data.draw(st.lists(st.integers(1, tk), min_size=b, max_size=b), label="kv_lens"), np.int32)
    offsets = np.asarray(data.draw(st.lists(st.integers(0, tk), min_size=b, max_size=b), label="offsets"), np.int32)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    q, k, v = _qkv(rng, b, tq, tk, kvh, ratio, d, dtype)
    scale = 1 / math.sqrt(d)
    want = _reference_positions(q, k, v, lens, offsets[:, None] + np.arange(tq)[None], scale)
    got = flash_attention(
        q,
        _poison_tail(k, lens),
        _poison_tail(v, lens),
        scale=scale,
        q_offset=jnp.asarray(offsets),
        kv_lens=jnp.asarray(lens),
        block_q=block_q,
        block_k=block_k,
        backend=backend,
        kv_heads_per_block=kvh if (all_heads and backend == "tpu") else None,
    )
    _close(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_positions_with_padding_rows(backend):
    """Per-query positions as the engine's context step sends them: a chunk at 21..33 then
    padding queries at position 0 (which see key 0 only, as in the reference)."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 16, 40, 2, 2, 64, jnp.float32)
    pos = np.zeros((2, 16), np.int32)
    pos[0, :13] = np.arange(21, 34)
    pos[1, :5] = np.arange(3, 8)
    lens = np.asarray([34, 8], np.int32)
    want = _reference_positions(q, k, v, lens, pos, 0.125)
    got = flash_attention(
        q,
        _poison_tail(k, lens),
        _poison_tail(v, lens),
        scale=0.125,
        q_positions=jnp.asarray(pos),
        kv_lens=jnp.asarray(lens),
        block_q=8,
        block_k=16,
        backend=backend,
    )
    _close(got, want, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [1, 17])
def test_small_head_dim_and_short_rows(backend, t):
    """head_dim 16 (the engine's test model) and single-token rows; default block sizes."""
    rng = np.random.default_rng(t)
    q, k, v = _qkv(rng, 3, t, t, 2, 2, 16, jnp.float32)
    _close(
        flash_attention(q, k, v, scale=0.25, backend=backend), reference.causal_attention(q, k, v, 0.25), jnp.float32
    )


def test_fully_masked_rows_are_zero():
    """A query that sees no key (negative position) gets zeros, not NaN or an average."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 4, 8, 1, 1, 64, jnp.float32)
    pos = jnp.asarray([[-1, 0, -5, 3]], jnp.int32)
    for backend in BACKENDS:
        out = np.asarray(flash_attention(q, k, v, q_positions=pos, backend=backend))
        assert (out[0, [0, 2]] == 0).all() and np.isfinite(out).all()


def test_rejects_bad_arguments():
    q = jnp.zeros((1, 4, 3, 64))
    k = jnp.zeros((1, 4, 2, 64))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, k)
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q[:, :, :2], k, k, backend="cuda")
    with pytest.raises(ValueError, match="not both"):
        flash_attention(q[:, :, :2], k, k, q_offset=1, q_positions=jnp.zeros((1, 4), jnp.int32))


def export_for(platform: str, fn, *args):
    """Lower fn for a platform this machine does not have: runs the Pallas Mosaic/Triton
    lowering rules (block-shape legality, supported primitives) without compiling."""
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=skip)(*args)


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("d", [64, 128])
def test_compiled_lowerings(backend, platform, d):
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def f(q, k, v, seg, lens):
        a = flash_attention(q, k, v, segment_ids=seg, kv_lens=lens, backend=backend, interpret=False)
        b = flash_attention(q, k, v, q_offset=lens, backend=backend, interpret=False)
        return a, b

    exported = export_for(
        platform,
        f,
        sd((2, 300, 8, d), bf),
        sd((2, 300, 2, d), bf),
        sd((2, 300, 2, d), bf),
        sd((2, 300), jnp.int32),
        sd((2,), jnp.int32),
    )
    text = exported.mlir_module()
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text
