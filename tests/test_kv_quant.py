"""The 8-bit KV cache (kv_cache_dtype="int8" / "fp8"): the quantizer against a NumPy reference
(byte for byte), every attention path reading quantized pages against the jnp oracle on the
dequantized pages (NaN scales wherever no live context reaches), the page write and copy
paths, the pool's sizing and kv-math's, and the engine end to end: greedy outputs of the
int8-cache engine run alone equal the same engine batched (prefix caching, copy-on-write and
preemption on), every page back in the pool, zero compiles after warm-up."""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import cpu_isa, suite_xla_flags
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_pools import close, native_dense, page_pool, randn

from jaxserve import kv_math
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.models.model_config import ModelConfig
from jaxserve.runner import attention, model_runner, runner_config
from pallas_kernels import native, reference
from pallas_kernels import ragged_paged_attention as rpa

DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


TINY = np.finfo(np.float32).tiny  # 2^-126, float32's smallest normal


def np_quantize(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy reference of reference.quantize_kv: values below float32's smallest normal
    count as zero; scale = bfloat16(max|x| * float32(1/qmax)) per vector (last axis), rounded
    to nearest even by ml_dtypes (0 if below the smallest normal); q = x * (1/float32(scale))
    clipped to [-qmax, qmax], rounded half to even (int8) or cast with round-to-nearest-even
    (float8_e4m3fn); scale 0 -> q 0. Returns (q, scale as ml_dtypes.bfloat16)."""
    qmax = 127.0 if kind == "int8" else 448.0
    x = np.asarray(x, np.float32)
    x = np.where(np.abs(x) < TINY, np.float32(0), x)
    raw = (np.abs(x).max(-1) * np.float32(1.0 / qmax)).astype(np.float32)
    raw = np.where(raw < TINY, np.float32(0), raw)
    scale = raw.astype(ml_dtypes.bfloat16)
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, np.float32(1))
    inv = np.where(s32 > 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)
    y = np.clip(x * inv[..., None], -qmax, qmax).astype(np.float32)
    if kind == "int8":
        return np.rint(y).astype(np.int8), scale
    return y.astype(ml_dtypes.float8_e4m3fn), scale


def np_round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits by hand (round to nearest even on the uint32 bits, finite
    values): a check on ml_dtypes' rounding, which np_quantize relies on."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _tie_amax(qmax: float, up: bool) -> np.float32:
    """A max|x| whose max|x| * float32(1/qmax) lies exactly halfway between two bfloat16s, the
    lower one even (up=False: rounds down) or odd (up=True: rounds up)."""
    inv = np.float32(1 / qmax)
    for top in range(0x3F80, 0x4000, 2):  # bfloat16 bits in [1, 2): even
        tie = np.uint32(((top + up) << 16) | 0x8000).view(np.float32)
        a = np.float32(tie * np.float32(qmax))
        for _ in range(8):
            if a * inv == tie:
                return a
            a = np.nextafter(a, np.float32(np.inf) if a * inv < tie else np.float32(0))
    raise AssertionError("no tie found")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_matches_numpy_exactly(kind):
    qmax = 127.0 if kind == "int8" else 448.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 9, 3, 64)).astype(np.float32) * rng.lognormal(0, 3, (7, 9, 3, 1)).astype(np.float32)
    x[0, 0, 0] = 0.0  # a zero vector: scale 0, q 0
    x[0, 0, 1:3] = x[0, 1] = 0.0
    x[0, 0, 1, :2] = [1e-30, -1e-30]  # tiny
    x[0, 0, 2, :3] = [1e-39, -3e-40, 1e-45]  # denormals only: counted as zero
    x[0, 1, 0, :2] = [qmax * TINY * 1.01, 1e-39]  # scale just above float32's smallest normal
    x[0, 1, 1, :2] = [qmax * TINY * 0.99, -1.0e-37]  # scale just below it: 0
    x[0, 1, 2, :2] = [3.0, 1e-39]  # a denormal beside normal values: 0
    x[1, 1, 1] = np.linspace(-5, 5, 64)  # exact ties after scaling
    x[2, 2, 2, 3] = 3e38  # near float32's max
    x[3, 3, 0] = np.linspace(-1, 1, 64) * np.float32(qmax * (1 + 2**-9 - 2**-20))  # scale rounds down: clipped
    x[3, 3, 1] = np.linspace(-1, 1, 64, dtype=np.float32) * _tie_amax(qmax, up=False)  # the scale: a tie, to even
    x[3, 3, 2] = np.linspace(-1, 1, 64, dtype=np.float32) * _tie_amax(qmax, up=True)
    for dtype in (jnp.float32, jnp.bfloat16):
        xj = jnp.asarray(x).astype(dtype)
        x32 = np.asarray(xj.astype(jnp.float32))
        q, s = jax.jit(reference.quantize_kv, static_argnums=1)(xj, DTYPES[kind])
        want_q, want_s = np_quantize(x32, kind)
        assert q.dtype == DTYPES[kind] and s.dtype == jnp.bfloat16 and s.shape == x.shape[:-1]
        np.testing.assert_array_equal(_bits(s), _bits(want_s))
        np.testing.assert_array_equal(_bits(q), _bits(want_q))
        # the scale is max|x| / qmax rounded to nearest even bfloat16 (by hand, not ml_dtypes)
        raw = np.abs(np.where(np.abs(x32) < TINY, 0, x32)).max(-1).astype(np.float32) * np.float32(1 / qmax)
        np.testing.assert_array_equal(_bits(s), np.where(raw < TINY, 0, np_round_bf16(raw)))
        s32 = np.asarray(s.astype(jnp.float32))
        for i in [(0, 0, 0), (0, 0, 2), (0, 1, 1)]:
            assert (np.asarray(q[i]).astype(np.float32) == 0).all() and s32[i] == 0.0
        assert s32[0, 1, 0] > 0 and np.asarray(q[0, 1, 0, 1]).astype(np.float32) == 0
        assert np.asarray(q[0, 1, 2, 1]).astype(np.float32) == 0
        if dtype == jnp.float32:  # rounding the scale down pushed |x| / scale past qmax
            assert np.abs(x32[3, 3, 0]).max() / s32[3, 3, 0] > qmax
            assert float(np.abs(np.asarray(q[3, 3, 0]).astype(np.float32)).max()) == qmax
            ties = raw[3, 3, 1:3].view(np.uint32)
            assert ((ties & 0xFFFF) == 0x8000).all() and list(ties >> 16 & 1) == [0, 1]
            assert list(_bits(s)[3, 3, 1:3]) == [ties[0] >> 16, (ties[1] >> 16) + 1]
        # dequantized error: at most half a step (int8), float8's relative rounding otherwise
        # (+ the clip where the scale rounded down: at most qmax * 2^-8 steps); values that
        # count as zero are off by less than float32's smallest normal
        deq = np.asarray(reference.dequantize(q, s))
        err = np.abs(deq - x32)
        step = s32[..., None]
        bound = 0.5 * step if kind == "int8" else np.abs(deq) / 16 + step + qmax * 2**-8 * step
        bound = np.maximum(bound, np.where(s32 == 0, qmax * TINY, TINY)[..., None])
        assert (err <= bound * 1.0001).all()


_quantize = jax.jit(reference.quantize_kv, static_argnums=1)
_floats = st.floats(-1e6, 1e6, width=32) | st.sampled_from(
    [0.0, -0.0, 1e-38, -3e-39, 1e-45, 1.2e-38, 1.5e-36, -5.3e-36, 5.4e-36, 0.5, 1.5, 2.5, 65504.0]
)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["int8", "fp8"]), data=st.data())
def test_quantize_matches_numpy_hypothesis(kind, data):
    """Any float32 values (one shape, so one compile per dtype), denormals and the edge of a
    zero scale (qmax * 2^-126) among them: identical bytes and scales."""
    x = np.asarray(data.draw(st.lists(_floats, min_size=64, max_size=64), label="x"), np.float32).reshape(2, 2, 16)
    if data.draw(st.booleans(), label="zero vector"):
        x[1, 0] = 0.0
    q, s = _quantize(jnp.asarray(x), DTYPES[kind])
    want_q, want_s = np_quantize(x, kind)
    np.testing.assert_array_equal(_bits(s), _bits(want_s))
    np.testing.assert_array_equal(_bits(q), _bits(want_q))


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_write_kv_writes_the_quantized_bytes(kind):
    """write_kv puts quantize_kv's bytes and scales at the slots and hands back k/v as the
    pool now holds them (dequantized), so a fresh prompt sees what later steps read."""
    rng = np.random.default_rng(1)
    cache = reference.empty_kv_cache(6, 4, 2, 16, jnp.float32, kind)
    assert len(cache) == (2 if kind == "auto" else 4)
    k, v = randn(rng, (1, 5, 2, 16)), randn(rng, (1, 5, 2, 16))
    slots = jnp.asarray([[4, 5, 6, 13, 0]], jnp.int32)
    new, k_seen, v_seen = jax.jit(reference.write_kv)(cache, k, v, slots)
    flat = lambda a: np.asarray(a).reshape(24, *a.shape[2:])  # noqa: E731
    if kind == "auto":
        np.testing.assert_array_equal(flat(new[0])[[4, 5, 6, 13, 0]], np.asarray(k[0]))
        np.testing.assert_array_equal(np.asarray(k_seen), np.asarray(k))
        np.testing.assert_array_equal(np.asarray(v_seen), np.asarray(v))
        return
    for pages, scales, x, seen in ((new[0], new[2], k, k_seen), (new[1], new[3], v, v_seen)):
        want_q, want_s = np_quantize(np.asarray(x[0]), kind)
        np.testing.assert_array_equal(_bits(flat(pages)[[4, 5, 6, 13, 0]]), _bits(want_q))
        np.testing.assert_array_equal(_bits(flat(scales)[[4, 5, 6, 13, 0]]), _bits(want_s))
        want_seen = want_q.astype(np.float32) * want_s.astype(np.float32)[..., None]
        np.testing.assert_array_equal(np.asarray(seen[0]), want_seen)
        untouched = np.setdiff1d(np.arange(24), [4, 5, 6, 13, 0])
        assert scales.dtype == jnp.bfloat16 and (flat(scales)[untouched] == 0).all()


def _quantized_pool(rng, lens, ps, kvh, d, kind, even_width=False, poison=np.nan):
    """page_pool's layout quantized: (clean cache tuple, poisoned cache tuple, dequantized
    k, v, block tables). Poisoned: the scales of every slot no live context reaches are
    `poison` (NaN: a kernel that reads one fails; the XLA chunked loop reads whole chunks and
    masks scores, so it gets a large finite value)."""
    k, _, k_bad, _, bt = page_pool(rng, lens, ps, kvh, d, jnp.float32, even_width=even_width)
    v = randn(rng, k.shape)
    dead = jnp.isnan(k_bad[..., 0])
    qk, sk = reference.quantize_kv(k, DTYPES[kind])
    qv, sv = reference.quantize_kv(v, DTYPES[kind])
    bad = tuple(jnp.where(dead, poison, s) for s in (sk, sv))
    return (qk, qv, sk, sv), (qk, qv, *bad), reference.dequantize(qk, sk), reference.dequantize(qv, sv), bt


_oracle = jax.jit(reference.paged_attention, static_argnums=6)
_native = jax.jit(native_dense, static_argnums=6)
_chunked = jax.jit(reference.paged_attention_chunked, static_argnums=(6, 7))


@pytest.mark.parametrize(
    "t,ratio,d,ps,max_len",
    [(1, 4, 64, 16, 700), (33, 8, 32, 32, 400), (3, 2, 40, 16, 130)],
)
def test_native_int8_matches_oracle(t, ratio, d, ps, max_len):
    """The C++ kernel on int8 pages + scales (decode, chunks within one and across two query
    blocks, vector and scalar head dims; random lengths, some rows inactive) against the
    oracle on the dequantized pages."""
    for seed in range(2):
        rng = np.random.default_rng(seed)
        lens = [max_len] + [int(x) if x >= t else 0 for x in rng.integers(0, max_len, 2)]
        _, bad, kd, vd, bt = _quantized_pool(rng, lens, ps, 2, d, "int8")
        q = randn(rng, (3, t, 2 * ratio, d))
        cl = jnp.asarray(lens, jnp.int32)
        pos = cl[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
        got = np.asarray(_native(q, *bad[:2], bt, cl, pos, 1 / math.sqrt(d), *bad[2:]))
        sees = (np.asarray(pos) >= 0) & (np.asarray(lens) > 0)[:, None]
        assert (got[~sees] == 0).all()
        close(got[sees], np.asarray(_oracle(q, kd, vd, bt, cl, pos, 1 / math.sqrt(d)))[sees], jnp.float32)


@pytest.mark.parametrize("isa", native.VECTOR_ISAS)
def test_native_int8_every_vector_variant(isa):
    best = native.best_cpu_isa()
    if native.ISAS.index(isa) > native.ISAS.index(best):
        pytest.skip(f"this host cannot run {isa} (best: {best})")
    with cpu_isa(isa) as now:
        assert now == isa
        rng = np.random.default_rng(7)
        _, bad, kd, vd, bt = _quantized_pool(rng, [300, 0, 41, 1], 8, 2, 64, "int8")
        for t in (1, 5):
            q = randn(rng, (4, t, 8, 64), jnp.bfloat16)
            cl = jnp.asarray([300, 0, 41, 1], jnp.int32)
            pos = jnp.maximum(cl[:, None] - t + jnp.arange(t)[None], 0)
            got = np.asarray(_native(q, *bad[:2], bt, cl, pos, 0.125, *bad[2:]).astype(jnp.float32))
            want = np.asarray(_oracle(q.astype(jnp.float32), kd, vd, bt, cl, pos, 0.125))
            close(got[[0, 2]], want[[0, 2]], jnp.bfloat16)


def test_native_refuses_fp8_pages():
    rng = np.random.default_rng(2)
    clean, _, _, _, bt = _quantized_pool(rng, [20], 8, 2, 32, "fp8")
    cl = jnp.asarray([20], jnp.int32)
    with pytest.raises(ValueError, match="int8"):
        native_dense(randn(rng, (1, 1, 4, 32)), *clean[:2], bt, cl, cl[:, None] - 1, 0.2, *clean[2:])


def test_native_kernel_takes_bfloat16_scales():
    """The FFI target reads the pool's bfloat16 scales as they are (ABI 3) and refuses the
    float32 scales of ABI 2 with an error naming them, instead of misreading their bytes."""
    assert native.available()  # loads the library and registers its targets (run alone, nothing has yet)
    rng = np.random.default_rng(5)
    clean, _, _, _, bt = _quantized_pool(rng, [20], 8, 2, 32, "int8")
    assert native.ABI_VERSION >= 3 and clean[2].dtype == jnp.bfloat16  # 3: bfloat16 scales
    q, cl = randn(rng, (1, 4, 32)), jnp.asarray([20], jnp.int32)
    call = jax.ffi.ffi_call(native.RAGGED_TARGET_Q8, jax.ShapeDtypeStruct(q.shape, q.dtype))
    args = (jnp.asarray([0, 1], jnp.int32), cl, bt, cl - 1)
    kw = {"scale": np.float32(0.2), "kv_heads_per_item": np.int64(0), "window": np.int64(0)}  # ABI 6: window
    np.testing.assert_array_equal(
        np.asarray(call(q, *clean, *args, **kw)),
        np.asarray(native.ragged_paged_attention(q, *clean[:2], *args, 0.2, *clean[2:])),
    )
    with pytest.raises(Exception, match="scales must be bfloat16"):
        np.asarray(call(q, *clean[:2], *(s.astype(jnp.float32) for s in clean[2:]), *args, **kw))


@pytest.mark.parametrize("kind", ["fp8"])
def test_xla_chunked_quantized_matches_oracle(kind):
    """The XLA serving loop on fp8 pages (int8: test_attention_dispatchers_read_quantized_pages)."""
    b, t, ratio, ps = 3, 3, 2, 4
    for seed in range(2):
        _check_chunked(np.random.default_rng(seed), kind, b, t, ratio, ps)


def _check_chunked(rng, kind, b, t, ratio, ps):
    lens = [int(x) for x in rng.integers(t, 90, b)]
    lens[0] = 90  # a fixed table width
    _, bad, kd, vd, bt = _quantized_pool(rng, lens, ps, 2, 16, kind, even_width=True, poison=1e30)
    q = randn(rng, (b, t, 2 * ratio, 16))
    cl = jnp.asarray(lens, jnp.int32)
    pos = cl[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    want = _oracle(q, kd, vd, bt, cl, pos, 0.25)
    got = _chunked(q, *bad[:2], bt, cl, pos, 0.25, 2, *bad[2:])
    close(got, want, jnp.float32)
    # the oracle itself reads quantized pages the same way
    close(_oracle(q, *bad[:2], bt, cl, pos, 0.25, *bad[2:]), want, jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "native", "pallas-tpu", "pallas-gpu"])
def test_attention_backends_read_quantized_pages(impl):
    """Every attention backend on an int8 cache tuple, one ragged step of three decode rows, a
    16-token chunk and padding: each reads the pages (poisoned past every live context, but
    for XLA's gather) like the oracle on the dequantized pages."""
    rng = np.random.default_rng(3)
    ps, kvh, d = 8, 2, 32
    lens, qlens = [37, 1, 66, 34], [1, 1, 1, 16]
    clean, bad, kd, vd, bt = _quantized_pool(rng, lens, ps, kvh, d, "int8", even_width=True, poison=1e30)
    cache = clean if impl == "xla" else bad
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    n = int(qsl[-1]) + 5  # 5 padding tokens
    pos = np.zeros(n, np.int32)
    for r, (ln, m) in enumerate(zip(lens, qlens)):
        pos[int(qsl[r]) : int(qsl[r]) + m] = np.arange(ln - m, ln)
    pos = jnp.asarray(pos)
    cl = jnp.asarray(lens, jnp.int32)
    q = randn(rng, (n, 2 * kvh, d))
    k = v = jnp.zeros((n, kvh, d))
    want = reference.ragged_paged_attention(q, kd, vd, qsl, cl, bt, pos, 0.2)
    md = reference.RaggedMetadata(jnp.zeros_like(pos), bt, cl, qsl, pos)
    if impl in ("xla", "native"):
        fn = attention.make(impl).forward
    else:  # each lowering, interpreted
        fn = attention.paged_forward(
            functools.partial(rpa.ragged_paged_attention, interpret=True, backend=impl.split("-")[1])
        )
    got = jax.jit(lambda q, k, v, c, m: fn(q, k, v, c, m, scale=0.2))(q, k, v, cache, md)
    assert got.shape == q.shape and got.dtype == q.dtype
    close(got, want, jnp.float32)


def test_bfloat16_pool_holds_bits_and_every_reader_agrees():
    """kv_cache_dtype="bfloat16": the pool holds bfloat16 bits in uint16 pages (XLA:CPU scatters
    uint16 in place, bfloat16 not), write_kv hands back the rounded k/v, and the XLA and native
    backends read the pages as the oracle does on the bfloat16 values."""
    rng = np.random.default_rng(5)
    ps, kvh, d, h, n = 16, 2, 32, 4, 40
    cache = reference.empty_kv_cache(8, ps, kvh, d, jnp.float32, "bfloat16")
    assert cache[0].dtype == jnp.uint16 and len(cache) == 2
    k, v = randn(rng, (1, n, kvh, d)), randn(rng, (1, n, kvh, d))
    slots = jnp.arange(ps, ps + n, dtype=jnp.int32)
    cache, kk, vv = jax.jit(reference.write_kv)(cache, k, v, slots)
    np.testing.assert_array_equal(kk, k.astype(jnp.bfloat16).astype(jnp.float32))
    pool_k = reference.as_bf16(cache[0]).astype(jnp.float32)
    np.testing.assert_array_equal(pool_k.reshape(-1, kvh, d)[slots], kk[0])
    q = randn(rng, (n + 3, h, d))
    qsl, sl = jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32)
    bt, pos = jnp.asarray([[1, 2, 3, 4]], jnp.int32), jnp.arange(n + 3, dtype=jnp.int32)
    md = reference.RaggedMetadata(slots, bt, sl, qsl, pos)
    pool_v = reference.as_bf16(cache[1]).astype(jnp.float32)
    want = reference.ragged_paged_attention(q, pool_k, pool_v, qsl, sl, bt, pos, 0.2)
    for impl in ("xla", "native"):
        fn = attention.make(impl).forward
        close(jax.jit(lambda q, c, m: fn(q, None, None, c, m, scale=0.2))(q, cache, md), want, jnp.float32)


# -- the pool: sizing, resolve, copy -----------------------------------------------------


def _model_cfg(head_dim: int, layers: int = 2, kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )


def _pages(cfg: ModelConfig, dtype: str, kind: str, budget: int = 64 << 20) -> int:
    e = EngineConfig(dtype=dtype, kv_cache_dtype=kind, kv_cache_memory_bytes=budget, max_model_len=256)
    return runner_config.resolve(cfg, None, e, weight_bytes=0, max_logprobs=0).num_pages


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_int8_pool_holds_more_pages_at_a_fixed_budget(head_dim):
    """The engine's own sizing at a fixed kv_cache_memory_bytes, scale bytes counted:
    per token-head, int8 takes D + 2 bytes (a bfloat16 scale) against 4D (fp32), 2D (bf16).
    2D / (D + 2) >= 1.9 from D = 38: 1.94x at 64, 1.97x at 128; not at 16 (1.78x) or 32
    (1.88x), where the scale is a larger share of a token-head."""
    cfg = _model_cfg(head_dim)
    fp32, bf16 = _pages(cfg, "float32", "auto"), _pages(cfg, "bfloat16", "auto")
    int8, fp8 = _pages(cfg, "float32", "int8"), _pages(cfg, "bfloat16", "fp8")
    assert int8 == fp8
    assert int8 / fp32 >= 1.9
    assert int8 / fp32 == pytest.approx(4 * head_dim / (head_dim + 2), rel=1e-3)
    assert int8 / bf16 == pytest.approx(2 * head_dim / (head_dim + 2), rel=1e-3)
    assert (int8 / bf16 >= 1.9) == (head_dim >= 64)  # of 16, 32, 64, 128
    # kv-math says the same
    shape = cfg.shape()
    assert kv_math.kv_bytes_per_token(shape, "int8") == 2 * 2 * 2 * (head_dim + 2)
    assert kv_math.kv_bytes_per_token(shape, "bf16") / kv_math.kv_bytes_per_token(shape, "int8") == pytest.approx(
        2 * head_dim / (head_dim + 2)
    )
    assert runner_config.kv_bytes_per_token("float32", cfg, kv_cache_dtype="int8") == kv_math.kv_bytes_per_token(
        shape, "int8"
    )


def test_kv_math_capacity_follows_kv_dtype():
    """kv-math's plan for a real model (Llama-3.1-8B on an H100, 8k context): an 8-bit cache
    fits >= 1.9x the requests of a bf16 one, scales counted (2 x 128 / 130 = 1.97x the bytes)."""
    m = kv_math.resolve_model("llama-3.1-8b")
    bf16 = kv_math.plan(m, "h100", kv_dtype="bf16", context_len=8192)
    int8 = kv_math.plan(m, "h100", kv_dtype="int8", context_len=8192)
    assert int8.kv_bytes_per_token == 2 * 32 * 8 * (128 + 2)
    assert int8.max_concurrent_requests >= 1.9 * bf16.max_concurrent_requests
    lo8, _ = kv_math.decode_step_bounds(m, 32, 8192, 3.35e12, 1e15, kv_dtype="int8")
    lo16, _ = kv_math.decode_step_bounds(m, 32, 8192, 3.35e12, 1e15, kv_dtype="bf16")
    assert lo8 < lo16


def test_resolve_kv_cache_dtype_choices():
    cfg = _model_cfg(32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    e = EngineConfig(kv_cache_dtype="fp8", num_pages=64, max_model_len=128)
    assert runner_config.resolve(cfg, None, e, 0, 0).attention_impl in ("xla", "pallas")  # never native
    if native.available():
        with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*native"):
            runner_config.resolve(cfg, None, EngineConfig(**{**e.__dict__, "attention_impl": "native"}), 0, 0)
        rc = runner_config.resolve(
            cfg, None, EngineConfig(kv_cache_dtype="int8", num_pages=64, max_model_len=128), 0, 0
        )
        assert rc.attention_impl == "native" and rc.kv_cache_dtype == "int8"


def test_copy_pages_copies_scales():
    """The copy-on-write step copies pages and their scales, in every layer."""
    rng = np.random.default_rng(4)
    kv = tuple(
        tuple(jnp.asarray(rng.integers(-127, 128, s), jnp.int8) for s in [(6, 4, 2, 8)] * 2)
        + tuple(randn(rng, (6, 4, 2), jnp.bfloat16) for _ in range(2))
        for _ in range(2)
    )
    src, dst = jnp.asarray([1, 3, 0], jnp.int32), jnp.asarray([5, 2, 0], jnp.int32)
    out = jax.jit(model_runner._copy_pages)(kv, src, dst)
    for layer, new in zip(kv, out):
        for a, b in zip(layer, new):
            want = np.asarray(a).copy()
            want[[5, 2]] = np.asarray(a)[[1, 3]]
            np.testing.assert_array_equal(np.asarray(b), want)


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qllm(tok_model):
    from jaxserve import LLM

    return LLM(
        tok_model[0],
        max_slots=8,
        page_size=8,
        max_model_len=160,
        num_pages=40,
        token_buckets=(32, 64),
        kv_cache_dtype="int8",
    )


def test_int8_engine_alone_equals_batched_and_returns_every_page(qllm):
    """Greedy outputs of the int8-cache engine batched (shared prefixes, a partly shared page,
    a pool small enough to preempt) equal each request run alone on the same engine; the pool
    holds the engine's int8 pages and scales; nothing compiles after warm-up; every page is
    back in the pool afterwards."""
    from jaxserve import SamplingParams
    from jaxserve.runner.executable_cache import compile_count

    kv = qllm.runner.kv
    assert len(kv[0]) == 4 and kv[0][0].dtype == jnp.int8 and kv[0][2].dtype == jnp.bfloat16
    pool_bytes = sum(x.nbytes for layer in kv for x in layer)
    rc = qllm.runner.cfg
    assert pool_bytes == rc.num_pages * rc.page_size * runner_config.kv_bytes_per_token(
        rc.dtype, qllm.runner.model_cfg, kv_cache_dtype="int8"
    )
    rng = np.random.default_rng(0)
    shared = [int(x) for x in rng.integers(3, 512, 21)]  # 2 full pages and a partial one
    prompts = [shared + [int(x) for x in rng.integers(3, 512, int(n))] for n in rng.integers(0, 30, 6)]
    prompts += [[int(x) for x in rng.integers(3, 512, int(n))] for n in rng.integers(1, 60, 6)]
    outs = [int(x) for x in rng.integers(20, 70, len(prompts))]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outs]
    before = compile_count()
    qllm.generate([shared], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # cache the prefix
    batched = qllm.generate(prompts, params)
    assert qllm.scheduler.num_preemptions > 0
    assert sum(r.num_cached_prompt_tokens for r in batched) > 0
    alone = []
    for p, sp in zip(prompts, params):
        qllm.flush_prefix_cache()
        alone.append(qllm.generate([p], sp)[0].token_ids)
    assert compile_count() == before
    for r, a, m in zip(batched, alone, outs):
        assert len(r.token_ids) == m
        assert r.token_ids == a
    qllm.flush_prefix_cache()
    qllm.allocator.check()
    assert qllm.allocator.num_free == qllm.allocator.capacity, "pages leaked"


TP_SCRIPT = r"""
import json, sys
import numpy as np, jax
from jaxserve import LLM, SamplingParams
assert len(jax.devices()) == 4, jax.devices()
rng = np.random.default_rng(0)
prompts = [[int(x) for x in rng.integers(3, 512, int(n))] for n in rng.integers(2, 40, 4)]
params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(3, 20, 4)]
out = {}
for tp in (1, 2, 4):
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, kv_cache_dtype="int8", max_slots=1, page_size=8,
              max_model_len=64, num_pages=40, token_buckets=(64,))
    toks = [o.token_ids for o in llm.generate(prompts, params)]
    kv = llm.runner.target.kv[0]  # after the run: each step donates the pool and returns a new one
    out[tp] = {"tokens": toks, "shards": [list(x.addressable_shards[0].data.shape) for x in kv],
               "dtypes": [str(x.dtype) for x in kv], "impl": llm.runner.attention_impl}
print("RESULT" + json.dumps(out))
"""


def test_int8_cache_under_tensor_parallelism(tmp_path):
    """4 CPU devices (a subprocess): the int8 cache's scales split with their KV heads at tp=2
    (2 KV heads), replicated and sliced per chip at tp=4; greedy tokens equal one device's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import make_hf_model

    make_hf_model(
        "llama", tmp_path, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128
    )
    env = dict(os.environ, XLA_FLAGS=suite_xla_flags("--xla_force_host_platform_device_count=4"), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=Path(__file__).resolve().parents[1],
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(line[0][6:])
    assert out["2"]["tokens"] == out["4"]["tokens"] == out["1"]["tokens"]
    assert out["1"]["dtypes"] == ["int8", "int8", "bfloat16", "bfloat16"]
    assert out["2"]["shards"] == [[40, 8, 1, 8]] * 2 + [[40, 8, 1]] * 2  # pages and scales split by KV head
    assert out["4"]["shards"] == [[40, 8, 2, 8]] * 2 + [[40, 8, 2]] * 2  # 2 KV heads < 4 chips: replicated
