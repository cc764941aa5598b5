"""The native CPU matmul (pallas_kernels/native_matmul.py, cpu/matmul.cc) against float64 NumPy
on the unpacked weights: float32 and int8 panels, any row count (one register tile, several, the
remainder), K and N that are not multiples of the vector width or of a panel, every vector
variant; rows independent of each other; packing round trips; and the engine's default CPU step
runs on it, with no float copy of int8 weights.

bfloat16 weights on the AMX tiles: against float64 NumPy on the bf16-rounded x and weights (the
kernel's own rounding; products exact in float32, sums float32), every tile shape (1-16 rows,
17-32, several blocks), K and N off the tile sizes, the LM head's shape; the engine's default
precision follows the host (AMX on: bfloat16; JAXSERVE_CPU_ISA=avx512: float32, today's exact
path), and bfloat16 greedy output mostly agrees with float32 on the shipped model. The suite runs
with AMX off (conftest); these tests turn it on around themselves (``amx`` fixture)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bf16_isas, bf16_weight_isas, cpu_isa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import native, native_matmul

EPS32 = float(np.finfo(np.float32).eps)


def test_native_matmul_is_built_here():
    """The CPU path this project ships (a failure here means XLA's dot is what runs)."""
    assert native_matmul.available(), native_matmul.unavailable_reason()


def _case(rows, k, n, seed, int8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if int8:
        q = rng.integers(-127, 128, (n, k)).astype(np.int8)
        s = (rng.random(n) * 0.1).astype(np.float32)
        w, scale = native_matmul.pack_int8(q, s)
        dense = q.T.astype(np.float64) * s.astype(np.float64)  # [K, N]
    else:
        dense = rng.standard_normal((k, n)).astype(np.float32)
        w, scale = native_matmul.pack(dense), None
        dense = dense.astype(np.float64)
    return x, w, scale, dense


def _check(y, x, dense):
    """Float32 sums in another order: |error| <= (K + 2) eps sum_k |x_k w_k| (the standard bound
    for a length-K dot product, doubled for the scale's own rounding)."""
    ref = x.astype(np.float64) @ dense
    mag = np.abs(x).astype(np.float64) @ np.abs(dense)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= 2 * (x.shape[1] + 2) * EPS32 * mag + 1e-30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 80),
    k=st.integers(1, 300),
    n=st.integers(1, 200),
    int8=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_numpy(rows, k, n, int8, seed):
    x, w, scale, dense = _case(rows, k, n, seed, int8)
    y = np.asarray(jax.jit(native_matmul.matmul, static_argnames="n")(x, w, scale, n=n))
    _check(y, x, dense)


@pytest.mark.parametrize("isa", native.VECTOR_ISAS)
def test_every_vector_variant(isa):
    """Each variant's tile height and slice width: rows past one tile, cut into balanced tiles of
    several heights (7 rows: 4 + 3 on AVX-512, 3 + 2 + 2 on AVX2; 13: 5 + 4 + 4, on AVX2 in its
    tall tiles of two vectors, used from 8 rows: 8 is one), int8 panels widened per tile (few
    rows) and into the scratch (many), a partial last panel."""
    before = native.cpu_isa()
    try:
        if native.set_cpu_isa(isa) != isa:
            pytest.skip(f"this host has no {isa}")  # a variant test, not a core one (the bf16 levels: above)
        for rows, k, n in (
            (1, 200, 37),
            (2, 50, 130),
            (3, 64, 64),
            (7, 77, 130),
            (8, 40, 100),
            (13, 513, 200),
            (70, 100, 65),
        ):
            for int8 in (False, True):
                x, w, scale, dense = _case(rows, k, n, rows, int8)
                _check(np.asarray(native_matmul.matmul(x, w, scale, n=n)), x, dense)
    finally:
        native.set_cpu_isa(before)


@pytest.mark.parametrize("int8", [False, True])
def test_rows_are_independent(int8):
    """A row's result does not depend on the other rows of the call or on how the work was split
    (batched == alone, bit for bit), which the engine's batch-invariance tests rely on."""
    x, w, scale, _ = _case(100, 130, 300, 7, int8)
    f = jax.jit(native_matmul.matmul, static_argnames="n")
    full = np.asarray(f(x, w, scale, n=300))
    for r in (0, 5, 6, 99):
        np.testing.assert_array_equal(np.asarray(f(x[r : r + 1], w, scale, n=300))[0], full[r])
    np.testing.assert_array_equal(np.asarray(f(x[3:17], w, scale, n=300)), full[3:17])


@pytest.mark.parametrize("int8", [False, True])
def test_live_rows_skip_the_padding(int8):
    """live_rows (traced): the first rows equal the full product bit for bit, the padding rows are
    zeros (a ragged step's padded tokens cost nothing and carry no garbage into the KV pool)."""
    x, w, scale, _ = _case(40, 130, 300, 3, int8)
    full = np.asarray(native_matmul.matmul(x, w, scale, n=300))
    f = jax.jit(lambda x, live: native_matmul.matmul(x, w, scale, n=300, live_rows=live))
    for live in (0, 1, 17, 40, 99):
        got = np.asarray(f(x, jnp.int32(live)))
        np.testing.assert_array_equal(got[: min(live, 40)], full[: min(live, 40)])
        assert not got[min(live, 40) :].any()


def test_pack_round_trips():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((33, 130)).astype(np.float32)
    p = native_matmul.pack(w)
    assert p.shape == (3, 33, 64) and np.all(p[2, :, 2:] == 0)  # zero-padded past N
    np.testing.assert_array_equal(np.asarray(native_matmul.unpack(p, 130)), w)
    q = rng.integers(-127, 128, (130, 33)).astype(np.int8)
    pq, s = native_matmul.pack_int8(q, np.ones(130, np.float32))
    assert pq.shape == (3, 33, 64) and s.shape == (192,) and np.all(s[130:] == 0)
    assert pq[0, 0, 4 * 1 + 2] == q[16 * 2 + 1, 0]  # byte 4i + j holds column 16j + i
    np.testing.assert_array_equal(np.asarray(native_matmul.unpack(pq, 130)), q.T)


def test_bad_shapes_name_the_argument():
    x, w, _, _ = _case(2, 8, 70, 0, False)
    with pytest.raises(ValueError, match="matmul"):
        native_matmul.matmul(x, w, n=200)  # n does not match the panels
    with pytest.raises(ValueError, match="scale"):
        native_matmul.matmul(x, w.astype(np.int8), n=70)  # int8 panels without their scales
    with pytest.raises(ValueError, match="pack"):
        native_matmul.pack(np.ones((4, 4), np.float64))


def _model(quant):
    from flax import nnx

    from jaxserve.models.linear import quantize_modules
    from jaxserve.models.llama import LlamaForCausalLM
    from jaxserve.models.model_config import ModelConfig

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    module = LlamaForCausalLM(cfg, dtype="float32", rngs=nnx.Rngs(0))
    quantize_modules(module, quant)
    return module


@pytest.mark.parametrize("quant", [None, "int8"])
def test_packed_model_equals_unpacked(quant):
    """Packing every projection (q/k/v fused into one product, gate/up into another) changes the
    logits only by float32 summation order; the compiled forward calls the kernel once per
    product and, with int8 weights, holds no float32 copy of any of them."""
    from flax import nnx

    from jaxserve.models.linear import pack_native

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    module = _model(quant)
    want = np.asarray(module(tokens, positions)[0])
    assert pack_native(module) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    graphdef, state = nnx.split(module)
    fwd = jax.jit(lambda st, t, p: nnx.merge(graphdef, st)(t, p)[0])
    np.testing.assert_allclose(np.asarray(fwd(state, tokens, positions)), want, rtol=1e-4, atol=1e-4)
    hlo = fwd.lower(state, tokens, positions).compile().as_text()
    target = native_matmul.TARGET_Q8 if quant else native_matmul.TARGET_F32
    assert hlo.count(f'custom_call_target="{target}"') == 2 * 4 + 1
    if quant:
        assert not any(
            f"f32[{a},{b}]" in hlo for a, b in ((160, 64), (64, 160), (64, 128), (128, 64), (64, 320), (320, 64))
        )


def test_engine_packs_on_the_cpu_and_not_when_told():
    from flax import nnx

    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.runner import model_runner, runner_config

    cfg = _model(None).cfg
    for impl, want in ((None, "native"), ("xla", "xla")):
        rc = runner_config.resolve(cfg, None, EngineConfig(num_pages=16, max_model_len=64, matmul_impl=impl), 0, 0)
        assert rc.matmul_impl == want
        runner = model_runner.ModelRunner(_model(None), cfg, rc)
        leaves = {str(p[-1]) for p, _ in nnx.to_flat_state(runner.target.state)}
        assert ("packed" in leaves) == (want == "native") and ("kernel" in leaves) == (want == "xla")
    with pytest.raises(ValueError, match="matmul_impl"):
        EngineConfig(matmul_impl="blas")
    with pytest.raises(ValueError, match="matmul_impl"):
        runner_config.resolve(cfg, None, EngineConfig(matmul_impl="native", tensor_parallel_size=2), 0, 0)


# ---- bfloat16 weights: AMX tiles, AVX512-BF16 dot products, AVX2 / AVX-512 in float32 ----------


def _each_isa(isas):
    def each():
        for isa in isas:
            with cpu_isa(isa) as got:
                assert got == isa
                yield isa

    return each


@pytest.fixture
def bf16():
    """bfloat16 weights in the native kernel for one test, every variant the host has in turn
    (AVX2 and up; the suite runs with the bfloat16 units off: conftest): call the fixture's
    value to get an iterator of ISA names."""
    isas = bf16_weight_isas()
    if not isas:
        pytest.skip(f"the native bfloat16 matmul does not run here ({native_matmul.bf16_unavailable_reason()})")
    return _each_isa(isas)


@pytest.fixture
def bf16_units():
    """As ``bf16``, over the host's bfloat16 units only (AVX512-BF16, AMX): int8 weights in the
    pair layout (W8A16) run there alone."""
    isas = bf16_isas()
    if not isas:
        pytest.skip(f"this host has neither AVX512-BF16 nor AMX ({native_matmul.bf16_units_missing_reason()})")
    return _each_isa(isas)


def _bf16(a):
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _check_bf16(y, x, w):
    """Against the bf16-rounded operands in float64: every product is exact in float32 (8-bit
    mantissas), so only the float32 sums round: |error| <= (K + 2) eps sum_k |x_k w_k|."""
    xb, wb = _bf16(x), _bf16(w)
    ref, mag = xb @ wb, np.abs(xb) @ np.abs(wb)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= (x.shape[1] + 2) * EPS32 * mag + 1e-30)


def _bf16_case(rows, k, n, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(rows=st.integers(1, 80), k=st.integers(1, 300), n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_bf16_matches_numpy(bf16, rows, k, n, seed):
    x, w = _bf16_case(rows, k, n, seed)
    for _ in bf16():
        y = np.asarray(jax.jit(native_matmul.matmul, static_argnames="n")(x, native_matmul.pack_bf16(w), n=n))
        _check_bf16(y, x, w)


def test_bf16_tile_shapes_and_the_lm_head(bf16):
    """One row, a full 16-row tile, 17 and 32 (the two-block micro-kernel), 33 (both), a 130-row
    prefill chunk (several items and row blocks); K a multiple of 32 and not; the 56.4M bench
    model's LM head (512 -> 32000) at decode and prefill heights. The dot-product variant's
    blocks are 6 rows: 1-6, 7, 13 and 130 cover its every tail."""
    shapes = ((1, 64, 64), (5, 40, 70), (7, 64, 17), (16, 32, 16), (17, 96, 130), (32, 33, 64), (33, 513, 200))
    cases = [(_bf16_case(rows, k, n, rows), n) for rows, k, n in shapes + ((130, 256, 320),)]
    x, w = _bf16_case(40, 512, 32000, 1)
    p = native_matmul.pack_bf16(w)
    for _ in bf16():
        for (xc, wc), n in cases:
            _check_bf16(np.asarray(native_matmul.matmul(xc, native_matmul.pack_bf16(wc), n=n)), xc, wc)
        for rows in (1, 40):
            _check_bf16(np.asarray(native_matmul.matmul(x[:rows], p, n=32000)), x[:rows], w)


def test_bf16_rows_are_independent(bf16):
    x, w = _bf16_case(100, 130, 300, 7)
    p = native_matmul.pack_bf16(w)
    f = jax.jit(native_matmul.matmul, static_argnames="n")
    for _ in bf16():
        full = np.asarray(f(x, p, n=300))
        for r in (0, 5, 16, 31, 99):
            np.testing.assert_array_equal(np.asarray(f(x[r : r + 1], p, n=300))[0], full[r])
        np.testing.assert_array_equal(np.asarray(f(x[3:40], p, n=300)), full[3:40])


def test_bf16_live_rows(bf16):
    x, w = _bf16_case(20, 70, 130, 4)
    packed = jnp.asarray(native_matmul.pack_bf16(w))
    for _ in bf16():
        full = np.asarray(native_matmul.matmul(x, packed, n=130))
        got = np.asarray(jax.jit(lambda x: native_matmul.matmul(x, packed, n=130, live_rows=jnp.int32(9)))(x))
        np.testing.assert_array_equal(got[:9], full[:9])
        assert not got[9:].any()


def test_bf16_pack_layout():
    """Element [p, kb, 128 kk + 32 j + 2 c + e] holds w[32 kb + 2 kk + e, 64 p + 16 j + c] (row kk
    of AMX weight tile j: a k pair's 64 columns are contiguous), zero-padded past K and N; unpack
    inverts it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 130)).astype(np.float32)
    p = native_matmul.pack_bf16(w)
    assert p.shape == (3, 3, 2048) and p.dtype == jnp.bfloat16
    pf = p.astype(np.float32)
    for pi, kb, j, kk, c, e in ((0, 0, 0, 0, 0, 1), (1, 2, 3, 1, 15, 0), (0, 1, 2, 7, 4, 1)):
        assert pf[pi, kb, 128 * kk + 32 * j + 2 * c + e] == _bf16(w)[32 * kb + 2 * kk + e, 64 * pi + 16 * j + c]
    np.testing.assert_array_equal(np.asarray(native_matmul.unpack(p, 130, 70)), _bf16(w).astype(np.float32))
    full = np.asarray(native_matmul.unpack(p, 192, 96))
    assert np.all(full[70:] == 0) and np.all(full[:, 130:] == 0)


def test_bf16_on_avx2_is_the_float32_kernel_on_rounded_operands(bf16):
    """Without bfloat16 units the float32 kernel runs the bfloat16 panels, widening each weight by
    a shift: every row's result is bit for bit the float32 kernel's on bf16(x) and the unpacked
    weights, whatever its path (one row: the whole panel per pass; 2-7: pairs of k rows per
    load; 8 and more: the tall tiles), with an odd K's last row and several 256-long sum blocks."""
    f = jax.jit(native_matmul.matmul, static_argnames="n")
    for isa in bf16():
        if isa in native.BF16_ISAS:
            continue  # the bfloat16 units sum in their own order (checked against NumPy above)
        for rows, k, n in ((1, 577, 130), (3, 64, 64), (5, 301, 200), (8, 96, 70), (40, 513, 192), (130, 33, 65)):
            x, w = _bf16_case(rows, k, n, rows + k)
            p = native_matmul.pack_bf16(w)
            want = f(_bf16(x).astype(np.float32), native_matmul.pack(np.asarray(native_matmul.unpack(p, n, k))), n=n)
            np.testing.assert_array_equal(np.asarray(f(x, p, n=n)), np.asarray(want))


def test_bf16_off_falls_back_to_the_reference():
    """With the native kernels below AVX2 bfloat16 panels still give the right answer, through
    XLA (native_matmul.reference), and bf16_available() says why not."""
    with cpu_isa("generic"):
        assert not native_matmul.bf16_available() and native_matmul.bf16_unavailable_reason()
        x, w = _bf16_case(5, 40, 70, 3)
        _check_bf16(np.asarray(native_matmul.matmul(x, native_matmul.pack_bf16(w), n=70)), x, w)


def test_environment_variable_turns_bf16_off():
    """JAXSERVE_CPU_ISA=avx512, read when the library loads, turns the bfloat16 units off for
    the process (what this suite runs with, conftest); without it the host reports its best."""
    import os
    import subprocess
    import sys

    code = "from pallas_kernels import native, native_matmul; print(native.cpu_isa(), native_matmul.bf16_units())"
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_CPU_ISA"}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)  # noqa: E731
    best = native.best_cpu_isa()
    capped = native.ISAS[min(native.ISAS.index(best), native.ISAS.index("avx512"))]  # avx2 on an AVX2 host
    assert run({**env, "JAXSERVE_CPU_ISA": "avx512"}).stdout.split() == [capped, "False"]
    assert run(env).stdout.split() == [best, str(best in native.BF16_ISAS)]


def test_engine_precision_follows_the_host():
    """LLM(path) defaults to bfloat16 weights where AMX is on, float32 where it is off
    (JAXSERVE_CPU_ISA=avx512) or when dtype / matmul_dtype say float32; the reason is kept for the
    start-up log. An explicit bfloat16 runs on AVX2 (float32 arithmetic; int8 weights keep their
    float32 panels there) and is refused below it, naming the field."""
    from flax import nnx

    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.runner import model_runner, runner_config

    cfg = _model(None).cfg
    opts = dict(num_pages=16, max_model_len=64)
    resolve = lambda **o: runner_config.resolve(cfg, None, EngineConfig(**opts, **o), 0, 0)  # noqa: E731
    with cpu_isa("avx512"):
        rc = resolve()
        assert (rc.matmul_impl, rc.matmul_dtype) == ("native", "float32") and "AMX" in rc.matmul_reason
        assert rc.kv_cache_dtype == "auto"  # float32 pages
        runner = model_runner.ModelRunner(_model(None), cfg, rc)
        packed = [a for p, a in nnx.to_flat_state(runner.target.state) if str(p[-1]) == "packed"]
        assert packed and all(a.get_value().dtype == jnp.float32 for a in packed)
        rc = resolve(matmul_dtype="bfloat16")
        assert rc.matmul_dtype == "bfloat16" and "float32 arithmetic" in rc.matmul_reason
        runner = model_runner.ModelRunner(_model(None), cfg, rc)
        packed = [a.get_value() for p, a in nnx.to_flat_state(runner.target.state) if str(p[-1]) == "packed"]
        assert len(packed) == 2 * 4 + 1 and all(a.dtype == jnp.bfloat16 for a in packed)
        rc = resolve(matmul_dtype="bfloat16", quantization="int8")
        assert "int8 weights in float32 arithmetic" in rc.matmul_reason
        runner = model_runner.ModelRunner(_model("int8"), cfg, rc)
        packed = [a.get_value() for p, a in nnx.to_flat_state(runner.target.state) if str(p[-1]) == "packed"]
        assert all(a.dtype == jnp.int8 and a.shape[2] == native_matmul.PANEL for a in packed)
    with cpu_isa("generic"), pytest.raises(ValueError, match="matmul_dtype"):
        resolve(matmul_dtype="bfloat16")
    with pytest.raises(ValueError, match="matmul_dtype"):
        EngineConfig(matmul_dtype="float16")
    with pytest.raises(ValueError, match="matmul_dtype"):
        resolve(matmul_impl="xla", matmul_dtype="bfloat16")
    if not bf16_isas():
        return  # the rest needs a bfloat16 unit; the float32 side above is what such a host runs
    with cpu_isa(bf16_isas()[-1]):
        assert resolve().matmul_dtype == "bfloat16"
        assert resolve().kv_cache_dtype == "bfloat16"  # caches in bfloat16 too, as it computes
        assert resolve(dtype="float32").kv_cache_dtype == resolve(matmul_dtype="float32").kv_cache_dtype == "auto"
        assert resolve(dtype="float32").matmul_dtype == "float32"
        assert resolve(matmul_dtype="float32").matmul_dtype == "float32"
        assert resolve(dtype="float32", matmul_dtype="bfloat16").matmul_dtype == "bfloat16"
        runner = model_runner.ModelRunner(_model(None), cfg, resolve())
        packed = [a for p, a in nnx.to_flat_state(runner.target.state) if str(p[-1]) == "packed"]
        assert len(packed) == 2 * 4 + 1 and all(a.get_value().dtype == jnp.bfloat16 for a in packed)


def test_packed_bf16_model_is_close_and_calls_the_tile_kernel(bf16):
    """Every projection and the LM head on bfloat16 tiles: logits within bf16 rounding of the
    float32 model's, one tile-kernel call per product."""
    from flax import nnx

    from jaxserve.models.linear import pack_native

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    module = _model(None)
    want = np.asarray(module(tokens, positions)[0])
    assert pack_native(module, "bfloat16") == 2 * 4 + 1
    graphdef, state = nnx.split(module)
    fwd = jax.jit(lambda st, t, p: nnx.merge(graphdef, st)(t, p)[0])
    for _ in bf16():
        got = np.asarray(fwd(state, tokens, positions))
        assert np.max(np.abs(got - want)) <= 0.02 * np.max(np.abs(want))  # bf16: 2^-8 relative per operand
    hlo = fwd.lower(state, tokens, positions).compile().as_text()
    assert hlo.count(f'custom_call_target="{native_matmul.TARGET_BF16}"') == 2 * 4 + 1


def test_engine_bf16_greedy_mostly_agrees_with_float32(bf16):
    """The shipped model through LLM: bfloat16 weights (the AMX default) against float32, 8
    prompts x 24 greedy tokens. This 6.5M model's top two logits are often close, so a rounding
    difference can flip a token and the rest of the completion with it: the bound is loose
    (measured 2026-12-02: see docs/quantization.md), the exact figures are in the docs."""
    from conftest import TEST_MODEL

    from jaxserve import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 4000, 16)] for _ in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    with cpu_isa(bf16_weight_isas()[-1]):  # the host's best bfloat16 path on for the engines below
        for md in ("float32", "bfloat16"):
            # no warm-up: only the steps this test runs are compiled (test_llm covers warm-up)
            llm = LLM(TEST_MODEL, matmul_dtype=md, warmup=False, max_slots=8, max_model_len=48, token_buckets=(16,))
            assert f"matmul:native:{md}" in llm.core.model_info().features
            outs[md] = [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))]
            del llm
    first = [o[0] for o in outs["float32"]], [o[0] for o in outs["bfloat16"]]
    equal = sum(a == b for x, y in zip(outs["float32"], outs["bfloat16"]) for a, b in zip(x, y))
    print(f"bf16 vs fp32 greedy: {equal}/{8 * 24} tokens equal, first tokens {first}")
    assert sum(a == b for a, b in zip(*first)) >= 6 and equal >= 0.5 * 8 * 24


# ---- int8 weights on the bfloat16 units (W8A16) -------------------------------------------------


def _q8_bf16_case(rows, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    s = (rng.random(n) * 0.1 + 0.001).astype(np.float32)
    w, scale = native_matmul.pack_int8_bf16(q, s)
    return x, jnp.asarray(w), jnp.asarray(scale), q.T.astype(np.float64), s.astype(np.float64)


def _check_q8_bf16(y, x, q_kn, s):
    """Against bf16(x) @ q * s in float64: an int8 value is exact in bfloat16 and every product
    exact in float32, so only the float32 sums and the one scale multiply round."""
    xb = _bf16(x)
    ref, mag = (xb @ q_kn) * s, (np.abs(xb) @ np.abs(q_kn)) * s
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= (x.shape[1] + 3) * EPS32 * mag + 1e-30)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(rows=st.integers(1, 80), k=st.integers(1, 300), n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_int8_bf16_matches_numpy(bf16_units, rows, k, n, seed):
    """Rows 1-36 widen the int8 panel in registers per block of 6 rows; from 37 it is widened
    once into bfloat16 scratch (or the AMX tiles take it)."""
    x, w, scale, q_kn, s = _q8_bf16_case(rows, k, n, seed)
    for _ in bf16_units():
        y = np.asarray(jax.jit(native_matmul.matmul, static_argnames="n")(x, w, scale, n=n))
        _check_q8_bf16(y, x, q_kn, s)


def test_int8_bf16_rows_are_independent_across_widening_paths(bf16_units):
    """A row's result is bit-identical whether its call widens in registers (1, 17 rows) or once
    into scratch (37, 100 rows): the same bfloat16 values in the same order."""
    x, w, scale, _, _ = _q8_bf16_case(100, 130, 300, 7)
    f = jax.jit(native_matmul.matmul, static_argnames="n")
    for _ in bf16_units():
        full = np.asarray(f(x, w, scale, n=300))
        for r in (0, 5, 16, 31, 99):
            np.testing.assert_array_equal(np.asarray(f(x[r : r + 1], w, scale, n=300))[0], full[r])
        np.testing.assert_array_equal(np.asarray(f(x[3:20], w, scale, n=300)), full[3:20])
        np.testing.assert_array_equal(np.asarray(f(x[3:40], w, scale, n=300)), full[3:40])


def test_int8_bf16_live_rows(bf16_units):
    x, w, scale, _, _ = _q8_bf16_case(50, 70, 130, 4)
    for _ in bf16_units():
        full = np.asarray(native_matmul.matmul(x, w, scale, n=130))
        for live in (3, 45):
            got = np.asarray(
                jax.jit(lambda x, live=live: native_matmul.matmul(x, w, scale, n=130, live_rows=jnp.int32(live)))(x)
            )
            np.testing.assert_array_equal(got[:live], full[:live])
            assert not got[live:].any()


def test_int8_bf16_pack_layout():
    """Byte [p, kb, 128 kk + 64 l + 4 i + b] holds q[64 p + 16 (2 l + b // 2) + 8 (b % 2) + i // 2,
    32 kb + 2 kk + i % 2] (what cpu/matmul.cc's widen_pair_row shifts out), zero-padded past K
    and N; unpack inverts it; the scales are padded to whole panels."""
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (130, 70)).astype(np.int8)  # [N, K]
    p, s = native_matmul.pack_int8_bf16(q, np.arange(130, dtype=np.float32))
    assert p.shape == (3, 3, 2048) and p.dtype == np.int8 and s.shape == (192,) and not s[130:].any()
    for pi, kb, kk, ll, i, b in ((0, 0, 0, 0, 0, 0), (1, 2, 2, 1, 15, 3), (0, 1, 15, 1, 6, 2), (2, 0, 3, 0, 1, 1)):
        col, row = 64 * pi + 16 * (2 * ll + b // 2) + 8 * (b % 2) + i // 2, 32 * kb + 2 * kk + i % 2
        want = q[col, row] if col < 130 and row < 70 else 0
        assert p[pi, kb, 128 * kk + 64 * ll + 4 * i + b] == want
    np.testing.assert_array_equal(np.asarray(native_matmul.unpack(p, 130, 70)), q.T.astype(np.float32))
    assert native_matmul.pair_layout(jnp.asarray(p)) and not native_matmul.pair_layout(
        jnp.asarray(native_matmul.pack_int8(q, np.ones(130, np.float32))[0])
    )


def test_int8_bf16_off_falls_back_to_the_reference():
    with cpu_isa("avx512"):
        x, w, scale, q_kn, s = _q8_bf16_case(5, 40, 70, 3)
        _check_q8_bf16(np.asarray(native_matmul.matmul(x, w, scale, n=70)), x, q_kn, s)


def test_int8_model_on_bf16_units_calls_the_w8a16_kernel(bf16_units):
    """An int8 model packed for the bfloat16 units (the engine's default on such a host): logits
    within bf16 rounding of x of the unpacked int8 model's, one W8A16 call per product, and no
    float copy of any weight."""
    from flax import nnx

    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.models.linear import pack_native
    from jaxserve.runner import runner_config

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    module = _model("int8")
    want = np.asarray(module(tokens, positions)[0])
    with cpu_isa(bf16_isas()[0]):  # the engine packs W8A16 only where the units are on
        assert pack_native(module, "bfloat16") == 2 * 4 + 1
    packed = [a.get_value() for p, a in nnx.to_flat_state(nnx.state(module)) if str(p[-1]) == "packed"]
    assert all(a.dtype == jnp.int8 and a.shape[2] == 2048 for a in packed)
    graphdef, state = nnx.split(module)
    fwd = jax.jit(lambda st, t, p: nnx.merge(graphdef, st)(t, p)[0])
    for _ in bf16_units():
        got = np.asarray(fwd(state, tokens, positions))
        assert np.max(np.abs(got - want)) <= 0.02 * np.max(np.abs(want))
        cfg = _model(None).cfg
        rc = runner_config.resolve(cfg, None, EngineConfig(num_pages=16, max_model_len=64, quantization="int8"), 0, 0)
        assert rc.matmul_dtype == "bfloat16" and "W8A16" in rc.matmul_reason
    hlo = fwd.lower(state, tokens, positions).compile().as_text()
    assert hlo.count(f'custom_call_target="{native_matmul.TARGET_Q8_BF16}"') == 2 * 4 + 1
    assert not any(f"f32[{a},{b}]" in hlo for a, b in ((160, 64), (64, 160), (64, 320), (320, 64)))


@pytest.mark.parametrize("int8", [False, True])
def test_sums_in_blocks_of_k_are_closer_to_exact_than_one_running_sum(int8):
    """Each y element is summed over k in blocks (matmul.cc kSumBlock), the block sums then added
    in order: rounding error grows with about sqrt(block) + sqrt(K / block) rather than sqrt(K).
    Over the MLP's down projection (K = 1,536) that is about half the error of one running
    float32 sum in k order (NumPy's cumsum) against float64 (0.46-0.52x on one seed; bound 0.75x,
    as the order within a block differs between instruction sets), for any row count; one running sum
    was 2.5x as far from float64 as PyTorch's float32 matmul (measured once against a float64
    transformers forward of the default model)."""
    x, w, scale, dense = _case(16, 1536, 256, 11, int8)
    ref = x.astype(np.float64) @ dense
    running = np.cumsum(x[:, :, None] * dense.astype(np.float32)[None], axis=1, dtype=np.float32)[:, -1]
    f = jax.jit(native_matmul.matmul, static_argnames="n")
    for rows in (1, 16):
        y = np.asarray(f(x[:rows], w, scale, n=256)).astype(np.float64)
        ours, one_sum = np.abs(y - ref[:rows]).mean(), np.abs(running[:rows] - ref[:rows]).mean()
        print(f"{rows} rows: mean |error| {ours:.2e}, one running sum {one_sum:.2e} ({ours / one_sum:.2f}x)")
        assert ours < 0.75 * one_sum


# ---- the grouped matmul (a mixture-of-experts layer's experts in one call) ----

GROUP_SIZES = ([0, 3, 1, 0, 9, 2], [0, 0, 0, 1, 0, 0], [0, 0, 15, 0, 0, 0], [2, 40, 1, 0, 7, 50])


def _grouped_case(layout, k, n, seed):
    """G = 6 random weights packed as `layout` (f32 / q8 / bf16 / q8_bf16): the stacked packs and scales."""
    rng = np.random.default_rng(seed)
    if layout in ("q8", "q8_bf16"):
        q = rng.integers(-127, 128, (6, n, k)).astype(np.int8)
        s = (rng.random((6, n)) * 0.1).astype(np.float32)
        pack = native_matmul.pack_int8 if layout == "q8" else native_matmul.pack_int8_bf16
        return native_matmul.pack_stack(pack, q, s)
    w = rng.standard_normal((6, k, n)).astype(np.float32)
    return native_matmul.pack_stack(native_matmul.pack if layout == "f32" else native_matmul.pack_bf16, w), None


def _check_grouped(layout, k=70, n=130):
    """Each group's rows get exactly what the plain native matmul gives them against that
    group's weights (bit for bit: the same kernel, the same k order), whatever the other groups;
    rows past every group are zeros. Groups: empty ones, one row, all rows in one group, more rows
    than one work item."""
    w, scale = _grouped_case(layout, k, n, 3)
    f = jax.jit(native_matmul.grouped_matmul, static_argnames="n")
    one = jax.jit(native_matmul.matmul, static_argnames="n")
    for sizes in GROUP_SIZES:
        m = sum(sizes) + 3  # three rows past the groups
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        got = np.asarray(f(x, jnp.asarray(w), None if scale is None else jnp.asarray(scale), jnp.asarray(sizes), n=n))
        start = 0
        for g, rows in enumerate(sizes):
            if rows:
                want = one(x[start : start + rows], jnp.asarray(w[g]), None if scale is None else scale[g], n=n)
                np.testing.assert_array_equal(got[start : start + rows], np.asarray(want), err_msg=f"{sizes} {g}")
            start += rows
        assert not got[start:].any()
        ref = native_matmul.grouped_reference(x, jnp.asarray(w), scale, jnp.asarray(sizes), n=n)
        np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


@pytest.mark.parametrize("layout", ["f32", "q8"])
def test_grouped_matches_each_groups_matmul(layout):
    _check_grouped(layout)


def test_grouped_bf16_matches_each_groups_matmul(bf16):
    for _ in bf16():
        _check_grouped("bf16")


def test_grouped_int8_bf16_matches_each_groups_matmul(bf16_units):
    for _ in bf16_units():
        _check_grouped("q8_bf16")


def test_grouped_bad_shapes_are_named():
    w, _ = _grouped_case("f32", 8, 64, 0)
    with pytest.raises(ValueError, match="grouped_matmul: x"):
        native_matmul.grouped_matmul(np.ones((4, 8), np.float32), w, None, jnp.ones((5,), jnp.int32), n=64)
