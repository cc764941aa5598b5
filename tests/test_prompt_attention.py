"""The `cudnn` attention backend (runner/attention.py: prompt_split): fresh prompts through a
dense fused attention over the step's own k/v, every other row through the paged kernel, in
one call. On the CPU XLA's `dot_product_attention` stands in for cuDNN (the same code path,
`implementation="xla"`); under JAX_PLATFORMS=cuda `test_matches_oracle` runs cuDNN itself. The oracle is `reference.ragged_paged_attention` over the whole step.
Pages no live context reaches hold NaN. cuDNN itself is checked by lowering for CUDA with
jax.export: without a GPU the cuDNN path refuses to trace (it asks the CUDA plugin for cuDNN's
version), so the test answers that one question and lowers the rest for real."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from paged_pools import close, page_pool, randn

from jaxserve.runner import attention
from pallas_kernels import native, prompt_attention, reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import RaggedMetadata

_oracle = jax.jit(reference.ragged_paged_attention, static_argnums=7, static_argnames="sliding_window")


def step(rng, rows, pad, ps, kvh, ratio, d, dtype):
    """A flat step: rows of (query tokens, context) (context == tokens: a fresh prompt), then
    `pad` padding tokens. Each token's k/v is what its slot in the pages holds (the model writes
    them before attending). Returns (q, k, v, clean pages for the oracle, poisoned pages for the
    backend, metadata): the dense oracle multiplies NaN by zero, the backend must never read it."""
    qlens, ctxs = [t for t, _ in rows], [c for _, c in rows]
    k_pages, v_pages, kb, vb, bt = page_pool(rng, ctxs, ps, kvh, d, dtype, even_width=True)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    n = int(qsl[-1]) + pad
    pos = np.zeros(n, np.int32)
    slots = np.zeros(n, np.int32)  # padding: the dummy page
    for r, (t, c) in enumerate(rows):
        pos[qsl[r] : qsl[r + 1]] = c - t + np.arange(t)
    for i in range(int(qsl[-1])):
        r = int(np.searchsorted(qsl, i, side="right") - 1)
        slots[i] = int(bt[r, pos[i] // ps]) * ps + pos[i] % ps
    flat = lambda pages: pages.reshape(-1, kvh, d)[slots]  # noqa: E731
    md = RaggedMetadata(jnp.asarray(slots), bt, jnp.asarray(ctxs, jnp.int32), jnp.asarray(qsl), jnp.asarray(pos))
    q = randn(rng, (n, kvh * ratio, d), dtype)
    return q, flat(k_pages), flat(v_pages), (k_pages, v_pages), (kb, vb), md


@st.composite
def step_rows(draw):
    """1-5 rows: fresh prompts (1-80 tokens), chunks with a cached prefix, decode and verify
    rows, empty rows."""
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["fresh", "fresh", "chunk", "decode", "verify", "empty"]))
        t = {"fresh": draw(st.integers(1, 80)), "chunk": draw(st.integers(2, 40)), "decode": 1, "empty": 0}.get(
            kind, draw(st.integers(2, 5))
        )
        ctx = t if kind == "fresh" else t + draw(st.integers(1, 120)) if kind != "empty" else 0
        rows.append((t, ctx))
    return rows


ON_GPU = jax.default_backend() == "gpu"


def hybrid():
    """The cudnn backend: on a GPU cuDNN itself over the compiled ragged kernel (float32 steps
    then run wholly on the ragged kernel); elsewhere XLA standing in for cuDNN over the native
    paged kernel (fast on the CPU, and it never reads a dead slot: the poisoned pages would
    show it)."""
    if ON_GPU:
        return attention.make("cudnn", interpret=False)
    return attention.prompt_split("cudnn", native.ragged_paged_attention, "xla")


def run(backend, q, k, v, cache, md, scale, window=None):
    kw = {"window": window} if window else {}
    return jax.jit(lambda q, k, v, c, m: backend.forward(q, k, v, c, backend.metadata(m), scale=scale, **kw))(
        q, k, v, cache, md
    )


@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(
    rows=step_rows(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    kvh=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 4]),
    d=st.sampled_from([32, 64]),
    ps=st.sampled_from([8, 16]),
    pad=st.integers(0, 7),
    window=st.sampled_from([None, 5, 40]),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle(rows, dtype, kvh, ratio, d, ps, pad, window, seed):
    rng = np.random.default_rng(seed)
    q, k, v, clean, cache, md = step(rng, rows, pad, ps, kvh, ratio, d, dtype)
    scale = 1 / math.sqrt(d)
    want = _oracle(
        q, *clean, md.query_start_loc, md.seq_lens, md.block_tables, md.positions, scale, sliding_window=window
    )
    got = run(hybrid(), q, k, v, cache, md, scale, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    close(got, want, dtype)


def test_split_routes_fresh_rows_only():
    """A fresh prompt, a chunk after a cached prefix, a decode row, an empty row, padding: only
    the fresh row's tokens go to the dense kernel (first, in order), and only its seq_lens is
    hidden from the paged one."""
    rows = [(3, 10), (4, 4), (1, 7), (0, 0), (2, 2)]
    q, k, v, clean, cache, md = step(np.random.default_rng(0), rows, 3, 8, 1, 2, 32, jnp.float32)
    plan = prompt_attention.split(md)
    assert plan.fresh_count.tolist() == [6]
    assert plan.order[:6].tolist() == [3, 4, 5, 6, 8, 9]
    assert sorted(plan.order.tolist()) == list(range(13))
    assert plan.paged().seq_lens.tolist() == [10, 0, 7, 0, 0]
    assert np.flatnonzero(prompt_attention.fresh_tokens(plan)).tolist() == [3, 4, 5, 6, 8, 9]
    assert plan.token_row[-3:].tolist() == [5, 5, 5]  # padding: row R


def test_over_the_pallas_kernel():
    """The backend `make("cudnn", interpret=True)` builds: the paged rows through the Pallas
    ragged kernel, interpreted (the engine's CPU stand-in)."""
    rows = [(20, 20), (1, 33), (6, 50), (9, 9)]
    q, k, v, clean, cache, md = step(np.random.default_rng(1), rows, 2, 8, 2, 2, 32, jnp.float32)
    want = _oracle(q, *clean, md.query_start_loc, md.seq_lens, md.block_tables, md.positions, 0.2)
    backend = attention.make("cudnn", interpret=True)
    assert backend.name == "cudnn"
    close(run(backend, q, k, v, cache, md, 0.2), want, jnp.float32)


def test_float32_on_cudnn_stays_paged():
    """cuDNN takes 16-bit inputs: a float32 step under implementation="cudnn" runs every row
    through the paged kernel (no dense call is traced), and still equals the oracle."""
    rows = [(12, 12), (1, 20)]
    q, k, v, clean, cache, md = step(np.random.default_rng(2), rows, 0, 8, 1, 2, 32, jnp.float32)
    want = _oracle(q, *clean, md.query_start_loc, md.seq_lens, md.block_tables, md.positions, 0.3)
    backend = attention.prompt_split("cudnn", reference.ragged_paged_attention_chunked, "cudnn")
    close(run(backend, q, k, v, clean, md, 0.3), want, jnp.float32)  # (the XLA path reads dead V)
    assert not prompt_attention.supported(q, "cudnn")
    assert prompt_attention.supported(q.astype(jnp.bfloat16), "cudnn")


def test_cudnn_refuses_to_trace_without_a_gpu():
    """What jax 0.10.2 does on a host without the CUDA plugin: the cuDNN path asks for cuDNN's
    version while tracing. (On a GPU host this is not the case; the test says so.)"""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if fa.cuda_versions is not None:
        pytest.skip("the CUDA plugin is installed: cuDNN's version is known here")
    x = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn")).trace(x, x, x)


@pytest.mark.parametrize("d,ratio", [(64, 4), (128, 1)])
def test_cudnn_lowers_for_cuda(monkeypatch, d, ratio):
    """The whole backend lowered for CUDA: cuDNN's fused attention for the fresh rows and the
    ragged kernel's Triton lowering for the rest, in one exported step. cuDNN's version is
    answered (9.8) since no CUDA plugin is here to say it; nothing else is stubbed."""
    import jax._src.cudnn.fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    n, r, kvh, ps, num_pages, p = 256, 6, 2, 16, 64, 16
    kernel = functools.partial(ragged_paged_attention, backend="gpu", interpret=False)
    backend = attention.prompt_split("cudnn", kernel, "cudnn")

    def f(q, k, v, cache, slots, bt, sl, qsl, pos):
        md = backend.metadata(RaggedMetadata(slots, bt, sl, qsl, pos))
        return backend.forward(q, k, v, cache, md, scale=0.1)

    pages = sd((num_pages, ps, kvh, d), bf)
    kv = sd((n, kvh, d), bf)
    args = (sd((n, kvh * ratio, d), bf), kv, kv, (pages, pages), sd((n,), i32), sd((r, p), i32))
    args += (sd((r,), i32), sd((r + 1,), i32), sd((n,), i32))
    skip = [
        jax.export.DisabledSafetyCheck.custom_call(t) for t in ("__gpu$xla.gpu.triton", "__cudnn$fmhaScaleBiasSoftmax")
    ]
    text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=skip)(*args).mlir_module()
    assert "__cudnn$fmha" in text and "triton" in text
    assert "PADDING_CAUSAL" in text  # the fresh count bounds cuDNN's work, causal tiles skipped


def test_mask_keeps_rows_apart():
    """Two fresh prompts in one step must not see each other: the same prompts one per step
    give the same result as both in one step."""
    rng = np.random.default_rng(4)
    rows = [(7, 7), (9, 9)]
    q, k, v, clean, cache, md = step(rng, rows, 0, 8, 1, 1, 32, jnp.float32)
    plan = prompt_attention.split(md)
    both = prompt_attention.dense(q, k, v, plan, scale=0.25, implementation="xla")
    for lo, hi in ((0, 7), (7, 16)):
        one = dataclasses.replace(
            md,
            slot_mapping=md.slot_mapping[lo:hi],
            seq_lens=jnp.asarray([hi - lo], jnp.int32),
            query_start_loc=jnp.asarray([0, hi - lo], jnp.int32),
            positions=md.positions[lo:hi],
            block_tables=md.block_tables[:1],
        )
        alone = prompt_attention.dense(
            q[lo:hi], k[lo:hi], v[lo:hi], prompt_attention.split(one), scale=0.25, implementation="xla"
        )
        close(both[lo:hi], alone, jnp.float32)


def test_tokamax_matches_oracle():
    """attention_impl="tokamax" where PyPI tokamax is installed (optional): its XLA kernel, the
    CPU stand-in of its Mosaic GPU / Triton ones, in the same split step, against the oracle."""
    pytest.importorskip("tokamax")
    rows = [(30, 30), (1, 45), (5, 60), (12, 12)]
    q, k, v, clean, cache, md = step(np.random.default_rng(5), rows, 4, 8, 2, 4, 64, jnp.bfloat16)
    want = _oracle(q, *clean, md.query_start_loc, md.seq_lens, md.block_tables, md.positions, 0.125)
    backend = attention.prompt_split("tokamax", native.ragged_paged_attention, "tokamax-xla")
    close(run(backend, q, k, v, cache, md, 0.125), want, jnp.bfloat16)


def test_tokamax_lowers_for_cuda(monkeypatch):
    """tokamax's GPU kernels lowered for CUDA inside the split step, with its own cross-compile
    switch on (it checks the local device otherwise) and a Hopper's compute capability."""
    pytest.importorskip("tokamax")
    from tokamax._src import config, gpu_utils

    monkeypatch.setattr(gpu_utils, "_compute_capability", lambda device=None: 9.0)
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    n, r, kvh, d, ps = 256, 4, 2, 128, 16
    kernel = functools.partial(ragged_paged_attention, backend="gpu", interpret=False)

    def lowered(backend):
        def f(q, k, v, cache, slots, bt, sl, qsl, pos):
            md = backend.metadata(RaggedMetadata(slots, bt, sl, qsl, pos))
            return backend.forward(q, k, v, cache, md, scale=0.1)

        skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        with config.cross_compile(True):
            return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=skip)(*args).mlir_module()

    pages = sd((64, ps, kvh, d), bf)
    kv = sd((n, kvh, d), bf)
    args = (sd((n, 4 * kvh, d), bf), kv, kv, (pages, pages), sd((n,), i32), sd((r, 16), i32))
    args += (sd((r,), i32), sd((r + 1,), i32), sd((n,), i32))
    calls = "__gpu$xla.gpu.triton"
    paged_only = lowered(attention.AttentionBackend("pallas", attention.paged_forward(kernel))).count(calls)
    assert lowered(attention.prompt_split("tokamax", kernel, "tokamax")).count(calls) > paged_only >= 1
