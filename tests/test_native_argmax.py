"""The native CPU argmax (pallas_kernels/native_argmax.py, cpu/argmax.cc) against NumPy's argmax
(the first index of the row maximum) and runner/sampling.argmax: any row count and vocabulary
size (past and short of the vector and unroll widths), ties inside and across vector lanes,
rows of -inf (every token banned), every vector variant; a NaN still gives an id in range; and
the model runner uses it on the CPU without a mesh, sampling.argmax with one."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.runner import model_runner, runner_config, sampling
from pallas_kernels import native, native_argmax

pytestmark = pytest.mark.fast

_native = jax.jit(native_argmax.argmax)
_xla = jax.jit(sampling.argmax)


def test_native_argmax_is_built_here():
    """The CPU path this project ships (a failure here means XLA's reductions are what runs)."""
    assert native_argmax.available(), native_argmax.unavailable_reason()


def _logits(s: int, v: int, kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s, v)).astype(np.float32)
    if kind == "ties":  # few distinct values: the maximum repeats, in and across lanes
        x = np.round(x).astype(np.float32)
    elif kind == "constant":
        x = np.full((s, v), 1.5, np.float32)
    elif kind == "banned":  # -inf everywhere but a few rows' last token
        x[:] = -np.inf
        x[::2, -1] = 0.0
    elif kind == "late":  # the maximum twice, in the tail past the vector loop
        x[:, -1] = x[:, max(0, v - 2)] = 10.0
    return x


def _check(x: np.ndarray) -> None:
    ids = np.asarray(_native(x))
    assert ids.dtype == np.int32 and ids.shape == (x.shape[0],)
    np.testing.assert_array_equal(ids, np.argmax(x, axis=1))
    np.testing.assert_array_equal(ids, np.asarray(_xla(x)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    s=st.integers(1, 40),
    v=st.integers(1, 3000),
    kind=st.sampled_from(["normal", "ties", "constant", "banned", "late"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_numpy(s, v, kind, seed):
    _check(_logits(s, v, kind, seed))


@pytest.mark.parametrize("isa", native.VECTOR_ISAS)
def test_every_vector_variant(isa):
    """Each variant's width (4, 8 or 16 lanes, four running maxima): vocabularies just short of,
    at and past one and several unrolled steps, and the shipped model's 32,000."""
    before = native.cpu_isa()
    try:
        if native.set_cpu_isa(isa) != isa:
            pytest.skip(f"this host has no {isa}")  # a variant test, not a core one
        for v in (1, 3, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 257, 1000, 32000):
            for kind in ("normal", "ties", "constant", "banned", "late"):
                _check(_logits(3, v, kind, v))
    finally:
        native.set_cpu_isa(before)


def test_nan_gives_an_id_in_range():
    x = _logits(6, 500, "normal", 0)
    x[0, 0] = np.nan  # where a lane starts
    x[1, 300] = np.nan
    x[2, :] = np.nan
    ids = np.asarray(_native(x))
    assert np.all((ids >= 0) & (ids < 500))
    np.testing.assert_array_equal(ids[3:], np.argmax(x[3:], axis=1))


def test_bad_shapes_name_the_argument():
    for bad in (np.zeros((4,), np.float32), np.zeros((2, 0), np.float32), np.zeros((2, 3, 4), np.float32)):
        with pytest.raises(ValueError, match="logits"):
            native_argmax.argmax(bad)


def test_runner_uses_it_on_the_cpu_without_a_mesh():
    from flax import nnx

    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.models.llama import LlamaForCausalLM
    from jaxserve.models.model_config import ModelConfig

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    rc = runner_config.resolve(cfg, None, EngineConfig(num_pages=16, max_model_len=64), 0, 0)
    runner = model_runner.ModelRunner(LlamaForCausalLM(cfg, dtype="float32", rngs=nnx.Rngs(0)), cfg, rc)
    assert runner.target.argmax is native_argmax.argmax
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    assert model_runner.default_argmax(mesh) is sampling.argmax  # a custom call XLA cannot split
