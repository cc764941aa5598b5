"""`jaxserve bench kernels`: paged decode attention and ragged steps timed beside their bounds.

Decode attention reads each live K and V vector once, so its floor is
bytes / streaming bandwidth, with bytes = 2 x rows x context x kv_heads x head_dim x itemsize.
The bandwidth is measured in the same run (kv_math_cli.bandwidth_probe: a jitted sum over a
256 MiB array on the CPU, 4 GiB on an accelerator, best of 3) right before each cell, because
a shared host's memory speed moves from second to second. Every time is printed with that bound and the fraction of it reached.

Ragged steps (--ragged-steps): decode rows and a prompt chunk in one flat call, the shape of
the engine's mixed step, through the serving kernel (native ragged on the CPU, the ragged Pallas
kernel on a GPU or TPU) and the XLA path, each beside its bytes bound and, with
--peak-tflops, its FLOP bound.

Projections (--matmul KxN,...): a decode step's other reads, x [rows, K] times a [K, N] weight
(--matmul-rows), through the kernel the engine serves with (the native panels on the CPU:
bfloat16 where the host runs them, else float32, as --dtype asks) and XLA's dot on the same
values, each call on its own copy of the weights so that they come from memory, beside the bytes
bound (the weights once / the stream read) and, with --peak-tflops, the FLOP bound. One row is
where decode lives: the kernel should read at the stream's rate.

Mixture-of-experts layers (--moe ExHxF:K,...): one layer's experts for --moe-tokens tokens, each
routed to K distinct experts drawn at random, as the engine runs them (models/qwen3_moe.py): the
native grouped matmul (the experts packed per --dtype as the CPU runner packs them, and in int8)
and the XLA path (`grouped_swiglu`: a loop over tiles of each chosen expert's rows, ragged_dot on
an accelerator), over copies of the layer filling 4x the last-level cache, beside the bound: the
chosen experts' weight bytes (each read once) / the stream read.

Decode implementations: rows of one token through the ragged kernel this backend serves with (the
native C++ FFI kernel on the CPU, the Pallas kernel on a GPU or TPU) and the XLA path
(reference.ragged_paged_attention_chunked, the online-softmax loop over pages). Each is timed as a
decode step runs it: 8 calls (one per layer) inside one jitted fori_loop, each on its own pages and
fed the previous call's output, so no
dispatch sits between calls; the time is per call. The pool is larger than the last-level cache
and its pages are shuffled, so the KV comes from memory. The largest difference from the
reference (reference.paged_attention, a plain gather) is reported beside each time.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from pathlib import Path

from jaxserve.tools.bench import result

LOOP = 8  # kernel calls per timed jitted loop (the layers of a decode step)


def last_level_cache_bytes() -> int:
    for index in (3, 2):
        try:
            size = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
            return int(size.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
        except (OSError, ValueError):
            continue
    return 32 * 2**20


def _ints(text: str, field: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{field}: expected a comma list of integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"{field}: expected positive integers, got {text!r}")
    return out


def implementations(backend: str, scale: float) -> dict:
    """name -> f(q [B,H,D], k_pages, v_pages, block_tables, lens) -> [B,H,D]: a decode step, one
    token per row, through each of ragged_implementations."""
    import jax.numpy as jnp

    def decode(kernel):
        def f(q, kp, vp, bt, lens):
            qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
            return kernel(q, kp, vp, qsl, lens, bt, lens - 1, scale)

        return f

    return {name: decode(kernel) for name, kernel in ragged_implementations(backend).items()}


def run(args, argv) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.tools.kv_math_cli import bandwidth_probe
    from pallas_kernels import reference

    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    rows_list, contexts = _ints(args.rows, "rows"), _ints(args.contexts, "contexts")
    steps = _ragged_steps(args.ragged_steps)  # a bad item exits before any work
    shapes = _matmul_shapes(args.matmul)
    moe_layers = _moe_layers(args.moe)
    mm_rows = _ints(args.matmul_rows, "matmul_rows")
    try:
        heads, kv_heads = (int(x) for x in args.heads.split("/"))
    except ValueError:
        raise ValueError(f"heads: expected Q/KV, e.g. 8/4, got {args.heads!r}") from None
    if heads % kv_heads:
        raise ValueError(f"heads: query heads {heads} must be a multiple of KV heads {kv_heads}")
    d, page = args.head_dim or (64 if backend == "cpu" else 128), 16
    scale = 1 / math.sqrt(d)
    token_bytes = kv_heads * d * dtype.itemsize  # one token of K (or V)
    biggest = max(rows_list) * max(contexts) * token_bytes
    llc = last_level_cache_bytes() if backend == "cpu" else 0
    # every call of a loop on its own pages where the pool allows; the pool well over the cache
    num_pages = 1 + max(256 * 2**20, LOOP * biggest * 5 // 4, 4 * llc) // (page * token_bytes)
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    kp = jax.random.normal(key[0], (num_pages, page, kv_heads, d), dtype)
    vp = jax.random.normal(key[1], (num_pages, page, kv_heads, d), dtype)
    probe = bandwidth_probe()
    impls = implementations(backend, scale)
    oracle = jax.jit(lambda q, kp, vp, bt, lens: reference.paged_attention(q[:, None], kp, vp, bt, lens, lens[:, None] - 1, scale)[:, 0])  # fmt: skip
    rng = np.random.default_rng(0)
    width = -(-max(contexts) // page)
    width += width % 2
    rows_out, streams = [], []
    print(
        f"jax {jax.__version__}, {backend} ({jax.devices()[0].device_kind}), {dtype.name}, heads {heads}/{kv_heads}, "
        f"head_dim {d}, page {page}; time per call in jitted loops of {LOOP}; bound = live KV bytes / stream read",
        flush=True,
    )
    for b in rows_list:
        q = jax.random.normal(jax.random.PRNGKey(b), (b, heads, d), dtype)
        for ctx in contexts:
            need = -(-ctx // page)
            per_set = b * need
            n_sets = max(1, min((num_pages - 1) // per_set, 4 * LOOP))
            perm = 1 + rng.permutation(num_pages - 1)
            tables = np.zeros((n_sets, b, width), np.int32)  # padding entries -> the dummy page 0
            for i in range(n_sets):
                tables[i, :, :need] = perm[i * per_set : (i + 1) * per_set].reshape(b, need)
            groups = [jnp.asarray(tables[(np.arange(LOOP) + j) % n_sets]) for j in range(0, n_sets, LOOP)]
            lens = jnp.full((b,), ctx, jnp.int32)
            live = 2 * b * ctx * token_bytes
            want = oracle(q, kp, vp, groups[0][0], lens)
            for name, fn in impls.items():
                diff = float(jnp.max(jnp.abs(jax.jit(fn)(q, kp, vp, groups[0][0], lens).astype(jnp.float32) - want.astype(jnp.float32))))  # fmt: skip
                loop = _looped(fn)
                jax.block_until_ready(loop(q, kp, vp, groups[0], lens))  # compile
                times, fractions = [], []
                for rep in range(args.reps):
                    stream = probe()  # bytes/s, now; also pushes the last pages out of the cache
                    streams.append(stream / 1e9)
                    t0 = time.perf_counter()
                    jax.block_until_ready(loop(q, kp, vp, groups[rep % len(groups)], lens))
                    ms = (time.perf_counter() - t0) * 1e3 / LOOP
                    times.append(ms)
                    fractions.append(live / stream * 1e3 / ms)
                ms = statistics.median(times)
                stream_gbps = statistics.median(streams[-args.reps :])
                bound_ms = live / (stream_gbps * 1e9) * 1e3
                row = {
                    "name": "paged decode",
                    "impl": name,
                    "config": {
                        "rows": b,
                        "context": ctx,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "head_dim": d,
                        "page_size": page,
                        "dtype": dtype.name,
                    },  # fmt: skip
                    "ms": ms,
                    "bytes": live,
                    "gbps": live / ms / 1e6,
                    "stream_gbps": stream_gbps,
                    "bound_ms": bound_ms,
                    "fraction_of_bound": statistics.median(fractions),
                    "max_abs_diff": diff,
                }
                rows_out.append(row)
                print(
                    f"rows {b:3d} ctx {ctx:5d} {name:11s}: {ms:8.3f} ms | bound {bound_ms:7.3f} ms "
                    f"({live / 1e6:.1f} MB at {stream_gbps:.1f} GB/s) = {row['fraction_of_bound']:.2f} of bound, "
                    f"{row['gbps']:.1f} GB/s | max abs diff {diff:.1e}",
                    flush=True,
                )
    rows_out += bench_ragged(args, steps, backend, dtype, heads, kv_heads, d, probe, streams)
    rows_out += bench_matmul(args, shapes, mm_rows, backend, dtype, llc, probe, streams)
    rows_out += bench_moe(args, moe_layers, _ints(args.moe_tokens, "moe_tokens"), backend, dtype, llc, probe, streams)
    summary = {"stream_gbps_median": statistics.median(streams), "stream_gbps_best": max(streams)}
    print(f"streaming read: median {summary['stream_gbps_median']:.1f} GB/s, best {summary['stream_gbps_best']:.1f}")
    return result.document("kernels", argv, measurements=rows_out, summary=summary)


def _looped(call):
    """jit of LOOP calls in a fori_loop over stacked block tables [LOOP, B, P], each call's output
    fed into the next call's queries (so none can be skipped or reordered)."""
    import jax

    def loop(q, kp, vp, tabs, lens):
        def body(i, q):
            return q + (1e-9 * call(q, kp, vp, tabs[i], lens)).astype(q.dtype)

        return jax.lax.fori_loop(0, LOOP, body, q)

    return jax.jit(loop)


def _timed_cell(args, probe, streams, fn, call_args, want, nbytes: int, flops: int, *, label: str) -> dict | None:
    """fn(*call_args) timed --reps times, each call right after a stream-read probe, beside its
    bound: the larger of nbytes / the stream read and, with --peak-tflops, flops / peak. The
    measurement's fields (the JSON schema's), or None where this platform cannot run fn."""
    import jax
    import jax.numpy as jnp

    try:
        diff = float(jnp.max(jnp.abs(fn(*call_args).astype(jnp.float32) - want)))
        times = []
        for _ in range(args.reps):
            streams.append(probe() / 1e9)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*call_args))
            times.append((time.perf_counter() - t0) * 1e3)
    except Exception as e:  # an implementation this platform lacks
        print(f"{label}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return None
    return _bounded(args, times, streams, nbytes, flops, diff)


def _bounded(args, times: list[float], streams: list[float], nbytes: int, flops: int, diff: float) -> dict:
    """A cell's measurement fields (the JSON schema's): the median of `times` (ms) beside its
    bound, the larger of nbytes / the median of the last --reps stream reads and, with
    --peak-tflops, flops / peak."""
    ms = statistics.median(times)
    stream_gbps = statistics.median(streams[-args.reps :])
    bytes_ms = nbytes / (stream_gbps * 1e9) * 1e3
    flop_ms = flops / (args.peak_tflops * 1e12) * 1e3 if args.peak_tflops else 0.0
    bound_ms = max(bytes_ms, flop_ms)
    return {
        "ms": ms,
        "bytes": nbytes,
        "flops": flops,
        "tflops": flops / ms / 1e9,
        "gbps": nbytes / ms / 1e6,
        "stream_gbps": stream_gbps,
        "bound_ms": bound_ms,
        "bound": "flops" if flop_ms > bytes_ms else "bytes",
        "fraction_of_bound": bound_ms / ms,
        "max_abs_diff": diff,
    }


def _matmul_shapes(text: str) -> list[tuple[int, int]]:
    """'512x32000,1408x512' -> [(K, N), ...]; '' -> []."""
    out = []
    for part in (p for p in text.split(",") if p):
        try:
            k, n = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"matmul: expected KxN items (e.g. 512x32000), got {part!r}") from None
        if min(k, n) < 1:
            raise ValueError(f"matmul: {part!r} needs positive K and N")
        out.append((k, n))
    return out


def matmul_implementations(backend: str, dtype) -> dict:
    """name -> (pack(w [K, N] float32) -> weights, f(x [M, K], weights) -> float32 [M, N]): the
    engine's projection kernel for this backend and dtype (the native panels on the CPU where the
    library loads; bfloat16 panels where the host runs them) and XLA's dot in `dtype`."""
    import jax
    import jax.numpy as jnp

    impls = {}
    if backend == "cpu":
        from pallas_kernels import native_matmul as nm

        bf16 = dtype == jnp.bfloat16 and nm.bf16_available()
        if bf16 or (dtype == jnp.float32 and nm.available()):
            pack = nm.pack_bf16 if bf16 else nm.pack

            def native(x, w, n):
                return nm.matmul(x, w, n=n)

            impls["native"] = (pack, native)
        else:
            why = nm.bf16_unavailable_reason() if dtype == jnp.bfloat16 else nm.unavailable_reason()
            print(f"native matmul ({dtype.name}) unavailable: {why}", file=sys.stderr)

    def xla(x, w, n):
        return jax.lax.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    impls["xla"] = (lambda w: jnp.asarray(w, dtype), xla)
    return impls


def bench_matmul(args, shapes, rows_list, backend, dtype, llc: int, probe, streams) -> list[dict]:
    """x [rows, K] @ w [K, N] per --matmul shape and --matmul-rows, each implementation over
    copies of the weights filling 4x the last-level cache, 256 MiB on an accelerator (2 to 256
    copies, so a shape under 0.5 MB may be partly cached on the CPU), so that every call reads
    its weights from memory: the copies' calls run in one jitted function, each on its own copy,
    their outputs summed (so none is skipped); the time is per call. Bytes: the weights once,
    plus x and y; FLOPs 2 x rows x K x N. The oracle: x (rounded as the kernel rounds it) times
    the weights' values in float32 at the highest precision."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = []
    if not shapes:
        return out
    rng = np.random.default_rng(2)
    impls = matmul_implementations(backend, dtype)
    for k, n in shapes:
        w32 = rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.05)
        w_values = jnp.asarray(w32, dtype).astype(jnp.float32)  # what every implementation multiplies
        # x, and the oracle: x as the kernels round it times those values, once per row count
        cases = {}
        for m in rows_list:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32)
            xr = x.astype(dtype).astype(jnp.float32)
            cases[m] = (x, jax.lax.dot(xr, w_values, precision=jax.lax.Precision.HIGHEST))
        wbytes = k * n * dtype.itemsize
        fill = 4 * llc if llc else 256 << 20  # an accelerator's caches: well under 256 MiB
        copies = int(min(256, max(2, -(-fill // wbytes))))
        for name, (pack, fn) in impls.items():
            packed = pack(w32)
            ws = [jnp.array(packed, copy=True) for _ in range(copies)]

            def loop(x, ws, fn=fn, n=n):
                acc = fn(x, ws[0], n)
                for w in ws[1:]:
                    acc = acc + fn(x, w, n)
                return acc

            looped, single = jax.jit(loop), jax.jit(functools.partial(fn, n=n))
            for m, (x, want) in cases.items():
                diff = float(jnp.max(jnp.abs(single(x, ws[0]) - want)))
                jax.block_until_ready(looped(x, ws))  # compile
                times = []
                for _ in range(args.reps):
                    streams.append(probe() / 1e9)
                    t0 = time.perf_counter()
                    jax.block_until_ready(looped(x, ws))
                    times.append((time.perf_counter() - t0) * 1e3 / copies)
                nbytes = wbytes + m * (k * x.dtype.itemsize + n * 4)
                r = _bounded(args, times, streams, nbytes, 2 * m * k * n, diff)
                config = {"rows": m, "k": k, "n": n, "dtype": dtype.name, "weight_copies": copies}
                out.append({"name": "projection matmul", "impl": name, "config": config, **r})
                print(
                    f"matmul {m:4d} x {k}x{n} {name:7s}: {r['ms'] * 1e3:9.1f} us, {r['gbps']:.1f} GB/s, "
                    f"{r['tflops'] * 1e3:.0f} GFLOP/s | bound {r['bound_ms'] * 1e3:.1f} us ({r['bound']}: "
                    f"{nbytes / 1e6:.2f} MB at {r['stream_gbps']:.1f} GB/s) = {r['fraction_of_bound']:.2f} of bound | "
                    f"max abs diff {diff:.1e}",
                    flush=True,
                )
            del ws
    return out


def _ragged_steps(text: str) -> list[tuple[int, int, int, int]]:
    """'16x1024+256,0x0+2048' -> [(decode rows, their context, chunk tokens, chunk context)];
    a chunk is a fresh prompt (its context is its own tokens) unless written T@C."""
    out = []
    for part in (p for p in text.split(",") if p):
        try:
            dec, chunk = part.split("+")
            rows, ctx = (int(x) for x in dec.split("x"))
            t, c = (int(x) for x in chunk.split("@")) if "@" in chunk else (int(chunk), int(chunk))
        except ValueError:
            raise ValueError(f"ragged_steps: expected ROWSxCONTEXT+CHUNK[@CONTEXT] items, got {part!r}") from None
        if min(rows, ctx, t, c) < 0 or (rows and not ctx) or t > c or not (rows or t):
            raise ValueError(f"ragged_steps: {part!r} needs a context per decode row and chunk <= its context")
        out.append((rows, ctx, t, c))
    return out


def ragged_implementations(backend: str) -> dict:
    """name -> f(q [N,H,D], k_pages, v_pages, query_start_loc, seq_lens, block_tables, positions, scale):
    the kernel the engine's default attention backend serves with, and the XLA path."""
    from pallas_kernels import reference

    impls = {}
    if backend == "cpu":
        from pallas_kernels import native

        if native.available():
            impls["native"] = native.ragged_paged_attention
        else:
            print(f"native CPU kernel unavailable: {native.unavailable_reason()}", file=sys.stderr)
    else:
        from pallas_kernels.lowering import default_backend
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        lowering = default_backend()
        impls[f"pallas-{lowering}"] = functools.partial(ragged_paged_attention, backend=lowering, interpret=False)
    impls["xla"] = reference.ragged_paged_attention_chunked
    return impls


def ragged_case(rows, ctx, t, c, heads, kv_heads, d, dtype, rng, page: int = 16):
    """One ragged step's arguments (q, k_pages, v_pages, query_start_loc, seq_lens, block_tables,
    positions): `rows` decode rows at context `ctx` plus a `t`-token chunk at context `c`, pages
    scattered in a pool of just their number; with its bytes (every live K and V once, q and the
    output), FLOPs (4 x H x D per visible (query, key) pair, causal in the chunk) and config."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    lens = [ctx] * rows + ([c] if t else [])
    qlens = [1] * rows + ([t] if t else [])
    need = [-(-n // page) for n in lens]
    num_pages = 1 + sum(need)
    perm = 1 + rng.permutation(num_pages - 1)  # pages scattered in the pool
    bt = np.zeros((len(lens), max(need)), np.int32)
    used = 0
    for r, p in enumerate(need):
        bt[r, :p] = perm[used : used + p]
        used += p
    key = jax.random.split(jax.random.PRNGKey(rows * 7 + t), 3)
    kp = jax.random.normal(key[0], (num_pages, page, kv_heads, d), dtype)
    vp = jax.random.normal(key[1], (num_pages, page, kv_heads, d), dtype)
    q = jax.random.normal(key[2], (sum(qlens), heads, d), dtype)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    pos = np.concatenate([np.arange(L - k, L) for L, k in zip(lens, qlens)]).astype(np.int32)
    call_args = (q, kp, vp, jnp.asarray(qsl), jnp.asarray(lens, jnp.int32), jnp.asarray(bt), jnp.asarray(pos))
    nbytes = 2 * sum(lens) * kv_heads * d * dtype.itemsize + 2 * q.size * dtype.itemsize
    pairs = rows * ctx + sum(c - t + i + 1 for i in range(t))  # (query token, visible key)
    config = {"decode_rows": rows, "decode_context": ctx, "chunk_tokens": t, "chunk_context": c, "heads": heads,
              "kv_heads": kv_heads, "head_dim": d, "page_size": page, "dtype": dtype.name}  # fmt: skip
    return call_args, nbytes, 4 * heads * d * pairs, config


def bench_ragged(args, steps, backend, dtype, heads, kv_heads, d, probe, streams) -> list[dict]:
    """One ragged step's attention: decode rows plus a prompt chunk in one flat call, as the
    engine's mixed step runs it (runner/attention.py). Bytes: every row's live K and V once,
    plus q and the output; FLOPs: 4 x H x D per (query token, visible key) pair (causal inside
    the chunk). The bound is the larger of bytes / stream read and, with --peak-tflops, FLOPs /
    peak. Each call is timed alone (a chunk's call is long enough for dispatch not to matter)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import reference

    scale = 1 / math.sqrt(d)
    impls = ragged_implementations(backend)
    oracle = jax.jit(reference.ragged_paged_attention, static_argnums=7)
    rng = np.random.default_rng(1)
    out = []
    for rows, ctx, t, c in steps:
        call_args, nbytes, flops, config = ragged_case(rows, ctx, t, c, heads, kv_heads, d, dtype, rng)
        want = oracle(*call_args, scale).astype(jnp.float32)
        for name, fn in impls.items():
            f = jax.jit(functools.partial(fn, scale=scale))
            r = _timed_cell(
                args, probe, streams, f, call_args, want, nbytes, flops, label=f"ragged {name} {rows}x{ctx}+{t}"
            )
            if r is None:
                continue
            out.append({"name": "ragged step", "impl": name, "config": config, **r})
            print(
                f"ragged {rows:3d}x{ctx:<5d}+{t:4d}@{c:<5d} {name:11s}: {r['ms']:8.3f} ms, {r['gbps']:.1f} GB/s, "
                f"{r['tflops']:.2f} TFLOP/s | bound {r['bound_ms']:.3f} ms ({r['bound']}) = "
                f"{r['fraction_of_bound']:.2f} of bound | max abs diff {r['max_abs_diff']:.1e}",
                flush=True,
            )
    return out


def _moe_layers(text: str) -> list[tuple[int, int, int, int]]:
    """'32x512x256:4,...' -> [(E, H, F, K), ...]; '' -> []."""
    out = []
    for part in (p for p in text.split(",") if p):
        try:
            shape, k = part.lower().split(":")
            e, h, f = (int(x) for x in shape.split("x"))
            k = int(k)
        except ValueError:
            raise ValueError(f"moe: expected ExHxF:K items (e.g. 32x512x256:4), got {part!r}") from None
        if min(e, h, f, k) < 1 or k > e:
            raise ValueError(f"moe: {part!r} needs positive sizes and K <= E")
        out.append((e, h, f, k))
    return out


def moe_implementations(backend: str, dtype, width: int, hidden: int) -> dict:
    """name -> prepare(Experts) -> (arrays, f(x [M, H] float32, arrays, group_sizes) -> [M, H]):
    the native grouped matmul on the experts packed as the CPU runner packs them (--dtype's panels,
    and int8), and the XLA path (`grouped_swiglu`) on the float stacks in `dtype`."""
    import jax.numpy as jnp

    from jaxserve.models import qwen3_moe

    def packed(x, a, sizes):
        return qwen3_moe.packed_swiglu(x, *a, sizes, width=width, hidden=hidden)

    def native(weight_dtype: str, int8: bool):
        def prepare(ex):
            if int8:
                ex.quantize_stacks()
            ex.pack_native(weight_dtype)
            return tuple(None if v is None else v[...] for v in (ex.gate_up, ex.gate_up_scale, ex.down, ex.down_scale))

        return prepare

    impls = {}
    if backend == "cpu":
        from pallas_kernels import native_matmul as nm

        if nm.available():
            weight_dtype = "bfloat16" if dtype == jnp.bfloat16 and nm.bf16_available() else "float32"
            impls[f"native-{weight_dtype}"] = (native(weight_dtype, False), packed)
            impls["native-int8"] = (native(weight_dtype, True), packed)
        else:
            print(f"native grouped matmul unavailable: {nm.unavailable_reason()}", file=sys.stderr)

    def xla(x, a, sizes):
        return qwen3_moe.grouped_swiglu(x.astype(a[0].dtype), *a, sizes).astype(jnp.float32)

    # the XLA path in --dtype and, on the CPU, in float32 (what a float32 model's experts ran as before)
    for dt in dict.fromkeys([dtype, jnp.dtype(jnp.float32)] if backend == "cpu" else [dtype]):
        impls[f"xla-{dt.name}"] = (lambda ex, dt=dt: tuple(w.astype(dt) for w in ex.weights(jnp.float32)), xla)
    return impls


def bench_moe(args, layers, tokens_list, backend, dtype, llc: int, probe, streams) -> list[dict]:
    """One MoE layer's experts per --moe layer and --moe-tokens count, each implementation over
    copies of the layer's weights filling 4x the last-level cache (at least 2), so every call reads
    its experts from memory: the copies' calls in one jitted function, outputs summed; the time is
    per call. Bytes: the chosen experts' weights once (as each implementation stores them), plus
    x and y. The oracle: `grouped_swiglu` on the float32 stacks at XLA's highest precision."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxserve.models import qwen3_moe

    out = []
    for e, h, f, k in layers:
        cfg = SimpleNamespace(num_experts=e, hidden_size=h, moe_intermediate_size=f)
        cases = {}
        for t in tokens_list:
            rng = np.random.default_rng(t)
            chosen = np.stack([rng.permutation(e)[:k] for _ in range(t)])
            sizes = jnp.asarray(np.bincount(chosen.ravel(), minlength=e), jnp.int32)
            x = jax.random.normal(jax.random.PRNGKey(t), (t * k, h), jnp.float32)
            with jax.default_matmul_precision("highest"):
                stacks = qwen3_moe.Experts(cfg, jnp.float32, nnx.Rngs(0), 0.05).weights(jnp.float32)
                want = jax.jit(qwen3_moe.grouped_swiglu)(x, *stacks, sizes)
            cases[t] = (x, sizes, want, int(np.count_nonzero(np.asarray(sizes))))
        for name, (prepare, fn) in moe_implementations(backend, dtype, f, h).items():
            arrays = prepare(qwen3_moe.Experts(cfg, jnp.float32, nnx.Rngs(0), 0.05))
            layer_bytes = sum(a.nbytes for a in arrays if a is not None)
            fill = 4 * llc if llc else 256 << 20
            copies = int(min(64, max(2, -(-fill // layer_bytes))))
            ws = [tuple(None if a is None else jnp.array(a, copy=True) for a in arrays) for _ in range(copies)]

            def loop(x, ws, sizes, fn=fn):
                acc = fn(x, ws[0], sizes)
                for w in ws[1:]:
                    acc = acc + fn(x, w, sizes)
                return acc

            looped, single = jax.jit(loop), jax.jit(fn)
            for t, (x, sizes, want, touched) in cases.items():
                diff = float(jnp.max(jnp.abs(single(x, ws[0], sizes) - want)))
                jax.block_until_ready(looped(x, ws, sizes))  # compile
                times = []
                for _ in range(args.reps):
                    streams.append(probe() / 1e9)
                    t0 = time.perf_counter()
                    jax.block_until_ready(looped(x, ws, sizes))
                    times.append((time.perf_counter() - t0) * 1e3 / copies)
                nbytes = layer_bytes * touched // e + x.size * 4 * 2
                r = _bounded(args, times, streams, nbytes, 6 * x.shape[0] * h * f, diff)
                config = {"experts": e, "hidden": h, "width": f, "top_k": k, "tokens": t, "experts_touched": touched,
                          "dtype": dtype.name, "weight_copies": copies}  # fmt: skip
                out.append({"name": "moe experts", "impl": name, "config": config, **r})
                print(
                    f"moe {e}x{h}x{f}:{k} tokens {t:4d} ({touched} experts) {name:16s}: {r['ms']:8.3f} ms, "
                    f"{r['gbps']:.1f} GB/s | bound {r['bound_ms']:.3f} ms ({nbytes / 1e6:.2f} MB at "
                    f"{r['stream_gbps']:.1f} GB/s) = {r['fraction_of_bound']:.2f} of bound | max abs diff {diff:.1e}",
                    flush=True,
                )
            del ws
    return out
