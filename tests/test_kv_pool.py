"""The KV pool of every layer in one K and one V array (reference.stacked_pool, the runner's
pool off a mesh) against a cache tuple a layer: the same logits and the same pages, bit for bit,
through every write and read path (native and XLA attention, float and int8 pages), and the
page copy of copy-on-write reaches every layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.loader import load_model
from jaxserve.runner import model_runner
from pallas_kernels import reference
from pallas_kernels.reference import RaggedMetadata


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(graphdef, params, cfg) of a random 3-layer Llama in float32."""
    from conftest import make_hf_model
    from flax import nnx

    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", path, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=3)  # fmt: skip
    model, cfg = load_model(path, dtype=jnp.float32)
    return (*nnx.split(model), cfg)


def _backend(impl: str):
    from jaxserve.runner import attention
    from pallas_kernels import native

    if impl == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    return attention.make(impl)


@pytest.mark.parametrize("impl,kv_dtype", [("native", "bfloat16"), ("xla", "int8"), ("xla", "auto")])
def test_a_stacked_pool_runs_as_a_pool_a_layer(tiny_llama, impl, kv_dtype):
    from flax import nnx

    graphdef, params, cfg = tiny_llama
    backend = _backend(impl)
    ps, num_pages = 4, 8

    @jax.jit
    def step(kv, tokens, md):
        logits, kv = nnx.merge(graphdef, params)(
            tokens[None], md.positions[None], kv, md, backend.forward, token_index=jnp.arange(tokens.shape[0])
        )
        return logits, kv

    def run(kv, toks, start):
        pos = np.arange(start, start + len(toks), dtype=np.int32)
        table = np.array([3, 5, 1, 7, 2, 6], np.int32)  # pages out of order: an offset mistake shows
        md = RaggedMetadata(
            slot_mapping=jnp.asarray(table[pos // ps] * ps + pos % ps),
            block_tables=jnp.asarray(table[None]),
            seq_lens=jnp.asarray([start + len(toks)], jnp.int32),
            query_start_loc=jnp.asarray([0, len(toks)], jnp.int32),
            positions=jnp.asarray(pos),
        )
        return step(kv, jnp.asarray(toks, jnp.int32), md)

    layer = lambda: reference.empty_kv_cache(num_pages, ps, cfg.num_kv_heads, cfg.head_dim, jnp.float32, kv_dtype)  # noqa: E731
    pools = {"per layer": tuple(layer() for _ in range(cfg.num_layers)), "stacked": reference.stacked_pool(layer, 3)}
    rng = np.random.default_rng(0)
    prompt, nxt = rng.integers(2, cfg.vocab_size, 13).tolist(), rng.integers(2, cfg.vocab_size, 1).tolist()
    out = {}
    for name, kv in pools.items():
        first, kv = run(kv, prompt, 0)
        second, kv = run(kv, nxt, len(prompt))
        out[name] = (np.asarray(first), np.asarray(second), kv)
    a, b = out["per layer"], out["stacked"]

    # The native path is bit for bit whatever the program around it; XLA's dot and fusions follow
    # the program, so there float sums may differ in the last bits (an int8 page by one step).
    def check(x, y):
        x, y = np.asarray(x), np.asarray(y)
        if impl == "native":
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(
                x.astype(np.float64), y.astype(np.float64), atol=1e-4 if x.dtype.kind == "f" else 1
            )

    check(b[0], a[0])
    check(b[1], a[1])
    assert len(b[2]) == 1 and b[2][0][0].shape[0] == cfg.num_layers * num_pages
    for i, stacked in enumerate(b[2][0]):  # layer l's pages at l * P: the per-layer pools one after another
        check(stacked, np.concatenate([np.asarray(x[i]) for x in a[2]]))
    assert np.any(np.asarray(b[2][0][0])[2 * num_pages + 3] != 0)  # the last layer wrote its own pages


def test_copy_pages_in_a_stacked_pool_copies_every_layer():
    rng = np.random.default_rng(4)
    layers, pages = 3, 6
    per_layer = tuple(
        tuple(jnp.asarray(rng.integers(0, 2**16, (pages, 4, 2, 8)), jnp.uint16) for _ in range(2))
        for _ in range(layers)
    )
    stacked = (tuple(jnp.concatenate([x[i] for x in per_layer]) for i in range(2)),)
    src, dst = jnp.asarray([1, 3, 0], jnp.int32), jnp.asarray([5, 2, 0], jnp.int32)
    want = jax.jit(model_runner._copy_pages)(per_layer, src, dst)
    got = jax.jit(lambda kv, s, d: model_runner._copy_pages(kv, s, d, layers=layers))(stacked, src, dst)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[0][i]), np.concatenate([np.asarray(x[i]) for x in want]))


@pytest.mark.parametrize("impl", ["native", "xla"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_a_step_writes_the_donated_pool_in_place(tiny_llama, impl, tokens):
    """The compiled step holds no copy of a pool array: a batch-1 decode step (one token) once
    made XLA write each layer's token twice, into two whole copies of the pool, which cost a step
    time in proportion to the pool's size (90 ms at 64 MiB against 0.5 ms for two tokens)."""
    import re

    from flax import nnx

    graphdef, params, cfg = tiny_llama
    backend = _backend(impl)
    ps, num_pages = 4, 64

    def step(kv, toks, md):
        return nnx.merge(graphdef, params)(toks[None], md.positions[None], kv, md, backend.forward, logits_index=None)

    # a bfloat16 pool as the runner holds it: bfloat16 bits in uint16 pages (reference.BF16_BITS)
    layer = lambda: reference.empty_kv_cache(num_pages, ps, cfg.num_kv_heads, cfg.head_dim, reference.BF16_BITS)  # noqa: E731
    kv = reference.stacked_pool(layer, cfg.num_layers)
    pos = np.arange(7, 7 + tokens, dtype=np.int32)
    md = RaggedMetadata(
        slot_mapping=jnp.asarray(9 * ps + pos % ps),
        block_tables=jnp.asarray(np.full((1, 4), 9, np.int32)),
        seq_lens=jnp.asarray([7 + tokens], jnp.int32),
        query_start_loc=jnp.asarray([0, tokens], jnp.int32),
        positions=jnp.asarray(pos),
    )
    text = jax.jit(step, donate_argnums=0).lower(kv, jnp.zeros(tokens, jnp.int32), md).compile().as_text()
    pool_elems = int(np.prod(kv[0][0].shape))
    copies = [
        line.strip()[:120]
        for line in text.splitlines()
        if (m := re.search(r"= \w+\[([\d,]+)\][^ ]* copy\(", line))
        and np.prod([int(d) for d in m[1].split(",")]) == pool_elems
    ]
    assert not copies, copies
