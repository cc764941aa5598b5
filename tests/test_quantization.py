"""Weight-only int8 quantization: the quantization functions against a NumPy reference (bit for
bit), XLA's int8 matmul (the native one: tests/test_native_matmul.py), the loader's cache, logits of random
Llama/Qwen2/Mistral checkpoints within a derived bound of float32, the engine (batched greedy ==
alone, no compiles after warm-up) and tensor parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_hf_model, suite_xla_flags
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.models import linear, quantization
from jaxserve.models.loader import load_model

EPS32 = float(np.finfo(np.float32).eps)


def np_quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference: float32 throughout, scale = max|w| / 127 per row, round half to even."""
    w = np.asarray(w).astype(np.float32)
    scale = (np.max(np.abs(w), axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    out=st.integers(1, 40),
    inp=st.integers(1, 70),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.integers(-30, 30),
)
def test_quantize_matches_numpy_reference(out, inp, dtype, seed, log_scale):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, inp)) * 2.0**log_scale).astype(np.float32)
    w[rng.random(out) < 0.1] = 0  # all-zero channels: scale 0, q 0
    w.flat[rng.integers(0, w.size)] = 0.5 * 2.0**log_scale  # ties exist in practice too
    if dtype == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16)
    q, scale = quantization.quantize_int8(jnp.asarray(w))
    rq, rscale = np_quantize_int8(w)
    np.testing.assert_array_equal(np.asarray(scale), rscale)
    np.testing.assert_array_equal(np.asarray(q), rq)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32
    # the defining property: every weight within half a step of its channel's scale (plus the
    # float32 rounding of the scale, which |q| <= 127 multiplies, and of the product)
    deq = np.asarray(quantization.dequantize_int8(q, scale))
    assert np.all(np.abs(deq - w.astype(np.float32)) <= rscale[:, None] * (0.5 + 130 * EPS32) + 1e-45)


def test_xla_int8_matmul_is_the_dequantized_dot():
    """The XLA form (TPU/GPU, tensor parallelism) against float64 NumPy on the dequantized weights."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    q = rng.integers(-127, 128, (40, 96)).astype(np.int8)
    s = (rng.random(40) * 0.1).astype(np.float32)
    y = np.asarray(quantization.int8_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s)))
    ref = (x.astype(np.float64) @ q.T.astype(np.float64)) * s
    mag = (np.abs(x).astype(np.float64) @ np.abs(q.astype(np.float64)).T) * s
    assert np.all(np.abs(y - ref) <= 2 * 98 * EPS32 * mag)


def test_bad_quantization_names_the_field(tmp_path):
    from jaxserve.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        quantization.check_mode("fp8")
    # the executable store's key is built from the EngineConfig repr (runner_config.resolve), and
    # gin's ServeConfig and the CLI get a field / flag for every EngineConfig field
    assert "quantization='int8'" in repr(EngineConfig(quantization="int8"))
    from jaxserve import cli, serve_config

    assert "quantization" in serve_config.ENGINE_FIELDS
    assert cli.ENGINE_FLAGS["--quantization"][0] == "quantization"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = {}
    for kind in ("llama", "mistral", "qwen2"):
        d = tmp_path_factory.mktemp(f"q-{kind}")
        make_hf_model(kind, d, seed=1)
        out[kind] = d
    return out


def _params(module):
    return {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def test_loader_quantizes_and_caches(tiny, tmp_path):
    """int8 weights [out, in] equal the NumPy reference on the checkpoint's tensors; the cache
    holds them under a fingerprint of their own (float32 and int8 loads never share one); a
    second load restores the same bits; keep_full_precision leaves the LM head alone."""
    from safetensors.numpy import load_file

    path = tiny["llama"]
    tensors = load_file(str(next(path.glob("*.safetensors"))))
    cache_root = tmp_path / "cache"
    fp = load_model(path, dtype=jnp.float32, cache_dir=cache_root / "f")[0]
    q1 = load_model(path, dtype=jnp.float32, quantization="int8", cache_dir=cache_root / "q")[0]
    q2 = load_model(path, dtype=jnp.float32, quantization="int8", cache_dir=cache_root / "q")[0]
    p1, p2 = _params(q1), _params(q2)
    assert p1.keys() == p2.keys() and all(np.array_equal(p1[k], p2[k]) for k in p1)
    for name in ("q_proj", "down_proj"):
        owner = "self_attn" if name == "q_proj" else "mlp"
        key = f"model.layers.1.{owner}.{name}.weight"
        rq, rs = np_quantize_int8(tensors[key])
        np.testing.assert_array_equal(p1[f"('layers', 1, '{owner}', '{name}', 'weight')"], rq)
        np.testing.assert_array_equal(p1[f"('layers', 1, '{owner}', '{name}', 'weight_scale')"], rs)
    assert p1["('lm_head', 'weight')"].dtype == np.int8
    assert p1["('embed_tokens', 'embedding')"].dtype == np.float32  # looked up, not streamed
    np.testing.assert_array_equal(p1["('embed_tokens', 'embedding')"], _params(fp)["('embed_tokens', 'embedding')"])
    from jaxserve.models.loader import fingerprint

    assert len({fingerprint(path, jnp.float32), fingerprint(path, jnp.float32, "int8")}) == 2
    assert fingerprint(path, jnp.float32, "int8") != fingerprint(path, jnp.float32, "int8", ("lm_head",))
    kept = _params(load_model(path, dtype=jnp.float32, quantization="int8", keep_full_precision=("lm_head",))[0])
    assert kept["('lm_head', 'kernel')"].dtype == np.float32 and "('lm_head', 'weight')" not in kept


class _Delta(nnx.Variable):
    pass


class _Probe(nnx.Module):
    """Test instrumentation around one projection: records its input (eager forward) and adds a
    perturbation ``delta`` to its output (for the Jacobian of the logits w.r.t. that output)."""

    def __init__(self, inner, shape, seen: list):
        self.inner = inner
        self.delta = _Delta(jnp.zeros(shape, jnp.float32))
        self._seen = seen

    def __call__(self, x):
        if not isinstance(x, jax.core.Tracer):
            self._seen.append(np.asarray(x))
        return self.inner(x) + self.delta[...]


def _get(module, path):
    for p in path:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    return module


def _first_order_bound(fp_model, q_model, tokens, positions):
    """sum over projections l, positions t and output channels j of
    |d logits[-1] / d y_l[t, j]| * scale_l[j] / 2 * sum_i |x_l[t, i]|  (see the test docstring)."""
    b, t = tokens.shape
    probes = []
    for path, m in list(nnx.iter_modules(fp_model)):
        if isinstance(m, linear.Linear):
            seen: list = []
            setattr(_get(fp_model, path[:-1]), path[-1], _Probe(m, (b, t, m.kernel.get_value().shape[1]), seen))
            probes.append((tuple(path), seen, np.asarray(_get(q_model, path).weight_scale.get_value())))
    base = np.asarray(fp_model(tokens, positions)[0])[0, -1]  # eager: records each probe's input
    graphdef, deltas, rest = nnx.split(fp_model, _Delta, ...)

    def last_logits(d):
        return nnx.merge(graphdef, d, rest)(tokens, positions)[0][0, -1]

    jac = dict(nnx.to_flat_state(jax.jacrev(last_logits)(deltas)))
    bound = np.zeros(base.shape, np.float64)
    var = np.zeros(base.shape, np.float64)
    for path, seen, scale in probes:
        x = seen[0].astype(np.float64)  # [b, t, din]
        s = scale.astype(np.float64)
        r = s[None, None, :] / 2 * np.abs(x).sum(-1, keepdims=True)  # [b, t, dout]
        j = np.asarray(jac[path + ("delta",)].get_value(), np.float64)  # [vocab, b, t, dout]
        bound += np.einsum("vbtd,btd->v", np.abs(j), r)
        a = np.einsum("vbtd,bti->vdi", j, x)  # the logits' sensitivity to each weight w[d, i]
        var += np.einsum("vdi,d->v", a * a, s * s / 12)
    return base, bound, np.sqrt(var)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_logits_within_derived_bound(tiny, kind):
    """Last-position logits of int8 weights against float32, within a bound derived beforehand.

    Rounding w[j, i] to q[j, i] * s_j moves it by e[j, i], |e[j, i]| <= s_j / 2. A projection
    y = x W^T then moves by dy[t, j] = sum_i x[t, i] e[j, i], so |dy[t, j]| <= s_j / 2 *
    sum_i |x[t, i]| =: r[t, j] whatever the signs (the per-channel rounding bound). To first order
    the logits move by sum_l J_l dy_l, J_l the Jacobian of the last position's logits with respect
    to projection l's output (every projection of every layer and the LM head); each term is at
    most |J_l| r_l, so |d logits_v| <= B_v := sum_l sum_{t,j} |J_l[v, t, j]| r_l[t, j], with J and
    x taken from the float32 model. The neglected higher-order terms are products of at least two
    per-weight errors, each below 1/254 of a channel's largest weight, so they are a small
    fraction of B; the test allows 1.5 B, plus float32 rounding of the two forward passes
    (1e-4 of the largest logit), fixed before any measurement.

    B assumes every rounding error pushes the same way, and measured errors are under 1% of it.
    A second, tighter check (added after that measurement; 6 is the conventional count, not fitted):
    rounding errors of random weights behave as independent, uniform on [-s_j/2, s_j/2] (variance
    s_j^2 / 12), so to first order d logits_v has standard deviation sigma_v with sigma_v^2 =
    sum_l sum_{j,i} (sum_t J_l[v, t, j] x_l[t, i])^2 s_j^2 / 12; every logit is within 6 sigma_v
    (measured: at most about 3 sigma over 512 logits per model, as a Gaussian maximum would be).
    """
    path = tiny[kind]
    fp_model, cfg = load_model(path, dtype=jnp.float32, use_cache=False)
    q_model, _ = load_model(path, dtype=jnp.float32, quantization="int8", use_cache=False)
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, 12)), jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    got = np.asarray(q_model(tokens, positions)[0])[0, -1]
    base, bound, sigma = _first_order_bound(fp_model, q_model, tokens, positions)
    err = np.abs(got.astype(np.float64) - base)
    allowed = 1.5 * bound + 1e-4 * np.abs(base).max()
    assert np.all(err <= allowed), (err.max(), bound[np.argmax(err - allowed)])
    assert np.all(err <= 6 * sigma + 1e-4 * np.abs(base).max()), np.max(err / sigma)
    assert err.max() > 0  # the quantized model is not the float one


def test_engine_batched_greedy_equals_alone_no_compiles(tiny):
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.executable_cache import compile_count

    opts = dict(max_slots=8, page_size=8, max_model_len=96, num_pages=96, token_buckets=(16, 64))
    llm = LLM(tiny["llama"], quantization="int8", **opts)
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(1, 60)))] for _ in range(10)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(2, 20, 10)]
    before = compile_count()
    batched = llm.generate(prompts, params)
    assert compile_count() - before == 0
    for p, sp, r in zip(prompts[:5], params[:5], batched[:5]):
        assert llm.generate([p], [sp])[0].token_ids == r.token_ids
    assert compile_count() - before == 0
    w = llm.runner.target.state["layers"][0]["mlp"]["down_proj"]["packed"].get_value()
    assert w.dtype == jnp.int8  # packed for the native CPU matmul


TP_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np, jax
    from jaxserve import LLM, SamplingParams
    assert len(jax.devices()) == 4
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(2, 40)))] for _ in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    opts = dict(max_slots=4, page_size=8, max_model_len=96, num_pages=64, token_buckets=(64,))
    out = {}
    for tp in (1, 2):
        llm = LLM(sys.argv[1], tensor_parallel_size=tp, quantization="int8", **opts)
        p = llm.runner.target.state
        shard = lambda a: [list(s.data.shape) for s in a.get_value().addressable_shards][:1]
        out[tp] = {"tokens": [o.token_ids for o in llm.generate(prompts, params)]}
        if tp == 1:  # one device: packed for the native matmul, compared by its tokens only
            continue
        out[tp] |= {"q": shard(p["layers"][0]["self_attn"]["q_proj"]["weight"]),
                   "q_scale": shard(p["layers"][0]["self_attn"]["q_proj"]["weight_scale"]),
                   "down": shard(p["layers"][0]["mlp"]["down_proj"]["weight"]),
                   "down_scale": shard(p["layers"][0]["mlp"]["down_proj"]["weight_scale"])}
    print("RESULT " + json.dumps(out))
""")


def test_tensor_parallel_int8(tiny):
    """tp=2 on host devices: int8 weights split with their output channels (column-parallel,
    scales too) or input channels (row-parallel, scales replicated); greedy tokens equal tp=1's."""
    path = tiny["llama"]
    env = dict(os.environ, XLA_FLAGS=suite_xla_flags("--xla_force_host_platform_device_count=4"), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=600,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["2"]["tokens"] == out["1"]["tokens"]
    assert out["2"]["q"] == [[64 // 2, 64]] and out["2"]["q_scale"] == [[64 // 2]]
    assert out["2"]["down"] == [[64, 160 // 2]] and out["2"]["down_scale"] == [[64]]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("q-qwen3_moe")
    make_hf_model("qwen3_moe", d, seed=1)
    return d


def _dequantized_twin(fp_model, q_model):
    """fp_model (in place) with every projection and expert stack holding q_model's int8 weights
    dequantized in float32: the float model the int8 one must compute."""
    from jaxserve.models import qwen3_moe

    for path, m in list(nnx.iter_modules(q_model)):
        twin = _get(fp_model, path)
        if isinstance(m, linear.Linear) and m.quantization == "int8":
            twin.kernel = nnx.Param(quantization.dequantize_int8(m.weight[...], m.weight_scale[...]).T)
        elif isinstance(m, qwen3_moe.Experts):
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(twin, name, nnx.Param(getattr(m, name).dequantized(jnp.float32)))
    return fp_model


def test_moe_int8_experts_load_and_compute_their_dequantized_weights(tiny_moe):
    """A Qwen3-MoE with quantization="int8": each expert's int8 weights and scales are the NumPy
    reference on its checkpoint tensor (as a Linear's are), and the logits, through XLA and
    through the native CPU kernels (projections and the grouped expert matmul, int8 panels), are
    the float model's on the dequantized weights within float32 rounding (1e-4 of the largest
    logit); they differ from the float model's (the experts are quantized)."""
    from safetensors.numpy import load_file

    tensors = {}
    for f in tiny_moe.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    fp_model, cfg = load_model(tiny_moe, dtype=jnp.float32, use_cache=False)
    q_model, _ = load_model(tiny_moe, dtype=jnp.float32, quantization="int8", use_cache=False)
    params = _params(q_model)
    for name in ("gate_proj", "down_proj"):
        stack = "('layers', 0, 'mlp', 'experts', '{}', '{}')"
        for e in (0, cfg.num_experts - 1):
            rq, rs = np_quantize_int8(tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"])
            np.testing.assert_array_equal(params[stack.format(name, "weight")][e], rq)
            np.testing.assert_array_equal(params[stack.format(name, "weight_scale")][e], rs)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, 24)), jnp.int32)
    positions = jnp.arange(24, dtype=jnp.int32)[None]
    float_logits = np.asarray(fp_model(tokens, positions)[0])
    want = np.asarray(_dequantized_twin(fp_model, q_model)(tokens, positions)[0])
    tol = 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(q_model(tokens, positions)[0]), want, rtol=0, atol=tol)
    assert linear.pack_native(q_model, "float32") > 0 and q_model.layers[0].mlp.experts.packed_native
    assert q_model.layers[0].mlp.experts.gate_up.get_value().dtype == jnp.int8
    np.testing.assert_allclose(np.asarray(q_model(tokens, positions)[0]), want, rtol=0, atol=tol)
    assert np.abs(float_logits - want).max() > tol


def test_engine_loads_int8_moe_batched_greedy_equals_alone(tiny_moe):
    """The engine serves a Qwen3-MoE with quantization="int8" (experts packed int8 for the native
    grouped matmul): batched greedy equals each request alone, no compile after warm-up."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.executable_cache import compile_count

    opts = dict(max_slots=4, page_size=8, max_model_len=96, num_pages=64, token_buckets=(16, 64))
    llm = LLM(tiny_moe, quantization="int8", **opts)
    rng = np.random.default_rng(6)
    prompts = [[int(x) for x in rng.integers(3, 512, int(rng.integers(1, 50)))] for _ in range(6)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in rng.integers(2, 16, 6)]
    before = compile_count()
    batched = llm.generate(prompts, params)
    for p, sp, r in zip(prompts[:3], params[:3], batched[:3]):
        assert llm.generate([p], [sp])[0].token_ids == r.token_ids
    assert compile_count() - before == 0
    experts = llm.runner.target.state["layers"][0]["mlp"]["experts"]
    assert experts["gate_up"].get_value().dtype == jnp.int8 and experts["down"].get_value().dtype == jnp.int8
