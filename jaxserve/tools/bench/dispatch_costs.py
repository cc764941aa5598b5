"""What a jitted step's call costs the host by kind of argument, and what each remedy saves
(docs/architecture.md, "Why the step is called with ~220 arrays").

    python -m jaxserve.tools.bench.dispatch_costs kinds    # synthetic: 195 weights, 64 per-layer KV arrays or 2 stacked
    python -m jaxserve.tools.bench.dispatch_costs slices   # a slice of stacked / flattened weights feeding the native matmul
    python -m jaxserve.tools.bench.dispatch_costs step     # the engine's decode step, per-layer KV pool against stacked

Host time is the calling thread's CPU (`time.thread_time`) around the call; the device runs the
program after it returns, so wall time (the call and `block_until_ready`) is the device's.
Medians; the per-layer and stacked steps alternate call by call.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def timed(call, reps: int = 60, skip: int = 10) -> tuple[float, float]:
    """Median (host CPU ms, wall ms) of `call()` then block_until_ready."""
    host, wall = [], []
    for _ in range(reps):
        c0, w0 = time.thread_time(), time.perf_counter()
        out = call()
        c1 = time.thread_time()
        jax.block_until_ready(out)
        host.append(c1 - c0)
        wall.append(time.perf_counter() - w0)
    return 1e3 * float(np.median(host[skip:])), 1e3 * float(np.median(wall[skip:]))


def kinds(layers: int = 32, pages: int = 961) -> None:
    """195 small weights and a 32-layer pool of bfloat16 pages (uint16 bits, as the engine keeps
    them), one slot a layer written in place: per-layer pool (64 arrays in and out) against a
    stacked one (2), weights as arguments, stacked per kind (6) or closed over (const args)."""
    from pallas_kernels.reference import write_pages

    params = [jnp.full((128, 128), i, jnp.bfloat16) for i in range(195)]
    x = jnp.ones((64, 128), jnp.bfloat16)
    slots = jnp.arange(64, dtype=jnp.int32)[:, None] * 16
    new = jnp.ones((64, 1, 2, 64), jnp.uint16)

    def per_layer(p, kv, x):
        return [write_pages(k, new, slots) for k in kv], x + sum(q[0, 0] for q in p)

    def stacked(p, kv, x):
        k, v = kv
        for i in range(layers):
            k = write_pages(k, new, slots + i * pages * 16)
            v = write_pages(v, new, slots + i * pages * 16)
        return (k, v), x + sum(q[0, 0] for q in p)

    def make(fn, p, kv, closed=False):
        state = {"kv": kv}
        if closed:
            exe = jax.jit(lambda kv, x: fn(p, kv, x), donate_argnums=0).lower(kv, x).compile()
            args = lambda: (state["kv"], x)  # noqa: E731
        else:
            exe = jax.jit(fn, donate_argnums=1).lower(p, kv, x).compile()
            args = lambda: (p, state["kv"], x)  # noqa: E731

        def call():
            state["kv"], y = exe(*args())
            return y

        return call

    zeros = lambda n: jnp.zeros((n, 16, 2, 64), jnp.uint16)  # noqa: E731
    stacked_kv = lambda: (zeros(layers * pages), zeros(layers * pages))  # noqa: E731
    per_kind = [jnp.stack(params[i::6][:layers]) for i in range(6)]
    calls = {
        "195 weights, per-layer pool (64 in, 64 out)": make(
            per_layer, params, [zeros(pages) for _ in range(2 * layers)]
        ),
        "195 weights, stacked pool (2 in, 2 out)": make(stacked, params, stacked_kv()),
        "6 weights stacked per kind, stacked pool": make(stacked, per_kind, stacked_kv()),
        "weights closed over (const args), stacked pool": make(stacked, params, stacked_kv(), closed=True),
    }
    alternate(calls, reps=200)


def alternate(calls: dict, reps: int) -> None:
    """Each call in turn, `reps` times (order reversed every other pass), then the medians."""
    out = {name: ([], []) for name in calls}
    for i in range(reps):
        for name in calls if i % 2 else reversed(list(calls)):
            h, w = timed(calls[name], reps=1, skip=0)
            out[name][0].append(h)
            out[name][1].append(w)
    for name, (h, w) in out.items():
        print(f"{name:48s} host {np.median(h[2:]):.3f} ms a call, wall {np.median(w[2:]):.2f} ms")


def slices(layers: int = 16, k: int = 512, n: int = 1536, rows: int = 8) -> None:
    """The device cost of handing the native matmul (an XLA custom call) one layer of stacked or
    flattened weights: XLA:CPU copies a dynamic slice (lax.scan) or a static slice into a buffer
    of its own before the call."""
    from pallas_kernels import native_matmul as nm

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(nm.pack(rng.standard_normal((k, n)).astype(np.float32) * 0.02)) for _ in range(layers)]
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    proj = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
    layer = lambda h, w: jnp.tanh(nm.matmul(h, w, n=n) @ proj)  # noqa: E731
    size = ws[0].size

    def unrolled(ws, x):
        for w in ws:
            x = layer(x, w)
        return x

    def scanned(stack, x):
        return jax.lax.scan(lambda h, w: (layer(h, w), None), x, stack)[0]

    def flat(buf, x):
        for i in range(layers):
            x = layer(x, buf[i * size : (i + 1) * size].reshape(ws[0].shape))
        return x

    stack = jnp.stack(ws)
    print(f"{layers} layers of [{k}, {n}] float32 panels ({layers * size * 4 / 1e6:.0f} MB), {rows} rows")
    for name, fn, w in (("per-layer arrays", unrolled, ws), ("lax.scan over [L, ...]", scanned, stack),
                        ("static slices of one buffer", flat, stack.reshape(-1))):  # fmt: skip
        exe = jax.jit(fn).lower(w, x).compile()
        weight_sized = [
            m
            for m in re.findall(r"f32\[([\d,]+)\]\{[^}]*\} (?:copy|dynamic-slice|slice|fusion)\(", exe.as_text())
            if np.prod([int(d) for d in m.split(",")]) >= size
        ]
        ms = timed(lambda: exe(w, x), reps=40, skip=5)[1]
        print(f"{name:32s} {ms:7.2f} ms a call, {len(weight_sized)} weight-sized slice/copy ops in its HLO")


def step(model: str | None = None, rows: int = 64, context: int = 128, reps: int = 30) -> None:
    """The engine's decode step at `rows` rows, called as the runner calls it, with a per-layer KV
    pool against the stacked one (the default off a mesh), alternating; and with the batch
    already on the device, and the weights closed over."""
    from jaxserve.llm import LLM
    from jaxserve.runner import model_runner as mr
    from jaxserve.runner.step_batch import DUMMY_PAGE, GREEDY, Chunk
    from jaxserve.tools.bench.host import random_model

    if model is None:
        model = str(random_model(32, 128, 128256, Path(tempfile.mkdtemp(prefix="jaxserve-dispatch-"))))
    opts = dict(max_slots=rows, max_model_len=context + 176)
    pool, copy = mr._empty_pool, mr._copy_pages
    mr._empty_pool = lambda *a: pool(*a[:-1], 1)  # one cache tuple a layer
    mr._copy_pages = lambda kv, src, dst, layers=1: copy(kv, src, dst)
    per_layer = LLM(model, **opts)
    mr._empty_pool, mr._copy_pages = pool, copy
    engines = {"per-layer pool": per_layer, "stacked pool": LLM(model, **opts)}
    calls = {}
    for name, llm in engines.items():
        runner, w = llm.runner, llm.runner.target
        chunks = [Chunk([0], context, [DUMMY_PAGE] * runner.max_pages_per_seq, GREEDY)] * rows
        runner.step(chunks)
        t = mr.bucket_for(runner.token_buckets, rows)
        batch = runner.batch(chunks, runner.rows_for(t), t, feed=())
        exe = next(e for key, e in w.step._compiled.items() if key[1][0][0] == (t,))
        n = [len(jax.tree.leaves(a)) for a in (w.params, w.kv, batch)]
        print(f"{name}: {n[0]} weight arrays, {n[1]} pool arrays, {n[2]} batch arrays")

        def call(b, w=w, runner=runner, exe=exe):
            def f():
                w.kv, out, runner._prev_tokens = exe(w.params, w.kv, b, runner._prev_tokens, np.bool_(False))
                return out

            return f

        calls[name] = call(batch)
        calls[name + ", batch on the device"] = call(jax.device_put(batch))
        params, fn, nlp = w.params, w.step.jitted, runner.cfg.max_logprobs
        closed = jax.jit(lambda kv, b, prev, want: fn(params, kv, b, prev, want, num_logprobs=nlp), donate_argnums=0)
        cexe = closed.lower(w.kv, batch, runner._prev_tokens, np.bool_(False)).compile()

        def call_closed(w=w, runner=runner, cexe=cexe, batch=batch):
            w.kv, out, runner._prev_tokens = cexe(w.kv, batch, runner._prev_tokens, np.bool_(False))
            return out

        calls[name + ", weights closed over"] = call_closed
    alternate(calls, reps)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "kinds"
    {"kinds": kinds, "slices": slices, "step": step}[what](*sys.argv[2:3])
