"""The probes and kernels sections of `jaxserve bench device` (each run in a process of its own).

probes: the chip's two ceilings, measured rather than read off a datasheet: a copy (y = x + 1 over
a 4 GiB array: every byte read once and written once; the rate counts both) and an N x N x N
matmul (8192, bfloat16 on an accelerator; 2 N^3 FLOPs). Each the best of a few calls, timed on
the device's clock. Every later figure is set against them (device.py's `bound`).

kernels: attention at the serving shapes of an 8B Llama (32 query heads, 8 KV heads, head_dim
128), each implementation guarded: one that is missing or fails on this platform is recorded as
{"error": ...}, never stops the run.
- prefill, a fresh causal prompt of S tokens: jax.nn.dot_product_attention (XLA, cuDNN), jax's
  Mosaic GPU flash kernel (attention_mgpu), tokamax where it is installed, and jaxserve's own
  ragged kernel(s) on the prompt's pages (`kernels.ragged_implementations`). Bound: FLOPs / GEMM peak.
- ragged steps (decode rows at a context, plus an optional prompt chunk): jaxserve's ragged
  kernel and the XLA path. Bound: live KV bytes / copy rate (and FLOPs / peak for a chunk).
Every output is compared with a reference (the XLA attention; reference.ragged_paged_attention).
"""

from __future__ import annotations

import functools
import math
import statistics

from jaxserve.tools.bench.device_timing import Record, error_text, traced


def _dtype(plan: dict):
    import jax
    import jax.numpy as jnp

    return jnp.dtype(plan.get("dtype") or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))


def run_probes(plan: dict, rec: Record) -> None:
    """The copy and matmul probes; rec.extra["probes"] = {copy_gbps, gemm_tflops} (the ceilings)."""
    import jax
    import jax.numpy as jnp

    n_copy, n_gemm, reps = plan["copy_bytes"], plan["gemm_n"], plan["reps"]
    dtype = _dtype(plan)
    x = jnp.ones(n_copy // 4, jnp.float32)
    a = jax.random.normal(jax.random.PRNGKey(0), (n_gemm, n_gemm), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n_gemm, n_gemm), dtype)
    copy, gemm = jax.jit(lambda x: x + 1), jax.jit(jnp.matmul)
    jax.block_until_ready((copy(x), gemm(a, b)))  # compiled, outside the trace
    with traced() as t:
        for _ in range(reps):
            t.call("copy", lambda: copy(x))
            t.call("gemm", lambda: gemm(a, b))
    probes = {}
    for label, moved, flops, cfg in (
        ("copy", 2 * x.nbytes, 0, {"bytes": x.nbytes, "op": "y = x + 1, float32"}),
        ("gemm", 3 * a.nbytes, 2 * n_gemm**3, {"n": n_gemm, "dtype": dtype.name}),
    ):
        times, clock = t.times(label)
        best = min(times)
        row = {"name": f"probe {label}", "impl": "xla", "config": cfg, "ms": best, "ms_median": statistics.median(times),
               "timing": clock, "bytes": moved, "flops": flops}  # fmt: skip
        rec.add(row)
        probes[label] = row
    rec.extra["probes"] = {
        "copy_gbps": probes["copy"]["bytes"] / probes["copy"]["ms"] / 1e6,  # read + written, per second
        "gemm_tflops": probes["gemm"]["flops"] / probes["gemm"]["ms"] / 1e9,
        "trace_error": t.trace_error,
    }
    rec.flush()
    p = rec.extra["probes"]
    print(f"probes ({clock}): copy {p['copy_gbps']:.1f} GB/s (read + written), GEMM {p['gemm_tflops']:.2f} TFLOP/s")


def prefill_implementations(scale: float) -> dict:
    """name -> f(q, k, v) [1, S, H, D] causal attention, or an Exception where it cannot be built here."""
    import jax

    impls: dict = {}
    for impl in ("xla", "cudnn"):
        impls[impl] = functools.partial(jax.nn.dot_product_attention, is_causal=True, scale=scale, implementation=impl)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

        cfg = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        # its logits are unscaled: q is scaled first (an elementwise pass, in the timed call)
        impls["mosaic-gpu"] = lambda q, k, v: mgpu.attention((q * scale).astype(q.dtype), k, v, cfg)
    except Exception as e:
        impls["mosaic-gpu"] = e
    try:
        import tokamax

        impls["tokamax"] = functools.partial(tokamax.dot_product_attention, is_causal=True, scale=scale)
    except Exception as e:
        impls["tokamax"] = e
    return impls


def _ragged_prefill(kernel, scale: float, page: int = 16):
    """A dense causal prefill through a ragged kernel: q, k, v [1, S, ...] laid into pages."""
    import jax.numpy as jnp

    def f(q, k, v):
        s, kvh, d = k.shape[1], k.shape[2], k.shape[3]
        pages = -(-s // page)
        pad = pages * page - s
        kp = jnp.pad(k[0], ((0, pad), (0, 0), (0, 0))).reshape(pages, page, kvh, d)
        vp = jnp.pad(v[0], ((0, pad), (0, 0), (0, 0))).reshape(pages, page, kvh, d)
        kp, vp = jnp.concatenate([jnp.zeros_like(kp[:1]), kp]), jnp.concatenate([jnp.zeros_like(vp[:1]), vp])
        bt = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
        qsl, lens = jnp.array([0, s], jnp.int32), jnp.array([s], jnp.int32)
        return kernel(q[0], kp, vp, qsl, lens, bt, jnp.arange(s, dtype=jnp.int32), scale)[None]

    return f


def _cell(rec: Record, t, name: str, impl: str, config: dict, fn, args, want, nbytes: int, flops: int, reps: int):
    """Compile, check against `want`, then time `reps` calls under the section's trace."""
    import jax
    import jax.numpy as jnp

    base = {"name": name, "impl": impl, "config": config, "bytes": nbytes, "flops": flops}
    if rec.left_s() <= 0:
        return rec.add({**base, "error": "skipped: the section's time budget was spent"})
    if isinstance(fn, Exception):
        return rec.add({**base, "error": error_text(fn)})
    label = f"{name} {impl} {sorted(config.items())}"
    try:
        f = jax.jit(fn)
        got = jax.block_until_ready(f(*args))
        diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        for _ in range(reps):
            t.call(label, lambda: f(*args))
    except Exception as e:
        return rec.add({**base, "error": error_text(e)})
    times, clock = t.times(label)  # the wall clock until the trace is read; then rewritten
    return rec.add({**base, "ms": statistics.median(times), "timing": clock, "max_abs_diff": diff, "_label": label})


def run_kernels(plan: dict, rec: Record) -> None:
    """Each plan["ragged"] step (the engine's kernel: decode first, a lease's first concern), then
    prefill at each of plan["prefill"]; see the module's doc."""
    import jax

    from jaxserve.tools.bench.kernels import ragged_implementations

    ragged = ragged_implementations(jax.default_backend())
    with traced() as t:
        _ragged_cells(plan, rec, t, ragged)
        _prefill_cells(plan, rec, t, ragged)
    for row in rec.rows:  # the device's clock, now that the trace is read
        if "_label" in row:
            times, row["timing"] = t.times(row.pop("_label"))
            row["ms"] = statistics.median(times)
    rec.extra["trace_error"] = t.trace_error
    rec.flush()


def _ragged_cells(plan: dict, rec: Record, t, ragged: dict) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.tools.bench.kernels import _ragged_steps, ragged_case
    from pallas_kernels import reference

    dtype, heads, kv_heads, d = _dtype(plan), plan["heads"], plan["kv_heads"], plan["head_dim"]
    scale = 1 / math.sqrt(d)
    oracle = jax.jit(reference.ragged_paged_attention, static_argnums=7)
    rng = np.random.default_rng(1)
    for rows, ctx, tok, c in _ragged_steps(plan["ragged"]):
        args, nbytes, flops, config = ragged_case(rows, ctx, tok, c, heads, kv_heads, d, dtype, rng)
        want = oracle(*args, scale).astype(jnp.float32)
        for impl, fn in ragged.items():
            f = functools.partial(fn, scale=scale)
            _cell(rec, t, "ragged step", f"jaxserve-{impl}", config, f, args, want, nbytes, flops, plan["reps"])


def _prefill_cells(plan: dict, rec: Record, t, ragged: dict) -> None:
    import jax
    import jax.numpy as jnp

    dtype, heads, kv_heads, d = _dtype(plan), plan["heads"], plan["kv_heads"], plan["head_dim"]
    scale = 1 / math.sqrt(d)
    for s in plan["prefill"]:
        keys = jax.random.split(jax.random.PRNGKey(s), 3)
        q = jax.random.normal(keys[0], (1, s, heads, d), dtype)
        k, v = (jax.random.normal(kk, (1, s, kv_heads, d), dtype) for kk in keys[1:])
        want = jax.jit(prefill_implementations(scale)["xla"])(q, k, v).astype(jnp.float32)
        impls = {**prefill_implementations(scale), **{f"jaxserve-{n}": _ragged_prefill(f, scale) for n, f in ragged.items()}}  # fmt: skip
        nbytes, flops = 2 * q.nbytes + k.nbytes + v.nbytes, 4 * heads * d * s * (s + 1) // 2
        config = {"tokens": s, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "dtype": dtype.name}
        for impl, fn in impls.items():
            _cell(rec, t, "prefill", impl, config, fn, (q, k, v), want, nbytes, flops, plan["reps"])
