"""The paged decode kernel (both lowerings, interpret mode on the CPU) against the jnp reference: page sizes 8/16/32, grouped-query ratios 1/2/4, head
dims 64/128, context lengths up to ~600 that end inside a page, float32 and bfloat16, the
TPU page-block and GPU split-K knobs. Pages outside every live context (unused pages, the
dummy page the block tables are padded with) and the tail of each last page hold NaN and
must not change the result. The compiled lowerings are checked to lower without a device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_pools import close, page_pool, randn

from pallas_kernels import reference
from pallas_kernels.paged_attention import combine_splits, paged_decode_attention

BACKENDS = ["tpu", "gpu"]


@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    b=st.integers(1, 3),
    kvh=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([64, 128]),
    ps=st.sampled_from([8, 16, 32]),
)
def test_paged_decode_matches_reference(data, backend, dtype, b, kvh, ratio, d, ps):
    lens = data.draw(st.lists(st.integers(1, 600), min_size=b, max_size=b), label="context_lens")
    if backend == "tpu":
        knobs = dict(
            pages_per_block=data.draw(st.sampled_from([None, 1, 3]), label="pages_per_block"),
            kv_heads_per_block=data.draw(st.sampled_from([None, kvh]), label="kv_heads_per_block"),
        )
    else:
        knobs = dict(
            pages_per_iter=data.draw(st.sampled_from([None, 1, 2, 4]), label="pages_per_iter"),
            num_splits=data.draw(st.sampled_from([None, 1, 3]), label="num_splits"),
        )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    k, v, k_bad, v_bad, bt = page_pool(rng, lens, ps, kvh, d, dtype, even_width=True)
    q = randn(rng, (b, kvh * ratio, d), dtype)
    cl = jnp.asarray(lens, jnp.int32)
    scale = 1 / math.sqrt(d)
    want = reference.paged_attention(q[:, None], k, v, bt, cl, cl[:, None] - 1, scale)[:, 0]
    got = paged_decode_attention(q, k_bad, v_bad, bt, cl, scale=scale, backend=backend, **knobs)
    close(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_slot_gives_zeros(backend):
    """An inactive decode slot (context length 0) reads nothing and returns zeros."""
    rng = np.random.default_rng(3)
    k, v, k_bad, v_bad, bt = page_pool(rng, [20, 1], 8, 2, 64, jnp.float32, even_width=True)
    q = randn(rng, (2, 4, 64))
    cl = jnp.asarray([20, 0], jnp.int32)
    out = np.asarray(paged_decode_attention(q, k_bad, v_bad, bt, cl, backend=backend))
    assert (out[1] == 0).all()
    want = reference.paged_attention(q[:1, None], k, v, bt[:1], cl[:1], cl[:1, None] - 1, 0.125)[:, 0]
    close(out[:1], want, jnp.float32)


def test_combine_splits_is_one_softmax():
    """Merging two halves' partial softmaxes equals the softmax over the whole row, and a
    split that saw nothing (l == 0) is ignored."""
    rng = np.random.default_rng(4)
    s = rng.standard_normal((2, 10)).astype(np.float32)
    v = rng.standard_normal((10, 3)).astype(np.float32)
    parts = []
    for cols in (slice(0, 4), slice(4, 10)):
        m = s[:, cols].max(-1)
        p = np.exp(s[:, cols] - m[:, None])
        parts.append((p @ v[cols], m, p.sum(-1)))
    parts.append((np.zeros((2, 3), np.float32), np.full((2,), -1e30, np.float32), np.zeros((2,), np.float32)))
    acc, m, l = (jnp.asarray(np.stack(x)) for x in zip(*parts))
    want = jax.nn.softmax(jnp.asarray(s), -1) @ v
    np.testing.assert_allclose(combine_splits(acc, m, l), want, atol=1e-6)


def export_for(platform: str, fn, *args):
    """Lower fn for a platform this machine does not have: runs the Pallas Mosaic/Triton
    lowering rules (block-shape legality, supported primitives) without compiling."""
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=skip)(*args)


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("d,ps", [(64, 8), (128, 16), (128, 32)])
def test_compiled_lowerings(backend, platform, d, ps):
    sd = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32
    b, kvh, h, n, p = 4, 2, 8, 64, 12

    def f(q, kp, vp, bt, cl):
        return paged_decode_attention(q, kp, vp, bt, cl, scale=0.1, interpret=False, backend=backend)

    exported = export_for(
        platform,
        f,
        sd((b, h, d), bf),
        sd((n, ps, kvh, d), bf),
        sd((n, ps, kvh, d), bf),
        sd((b, p), i32),
        sd((b,), i32),
    )
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in exported.mlir_module()
