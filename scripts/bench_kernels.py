"""Time the Pallas attention kernels against the jnp reference and jax.nn.dot_product_attention.

    python scripts/bench_kernels.py [--json results.json] [--backend tpu|gpu] [--reps N]
    python scripts/bench_kernels.py --native-cpu [--native-head-dims 32,64,128] [--json ...]

On a GPU or TPU: flash attention at B=1,2,4 x seq 1024/2048/4096, 32 query heads over 8 KV
heads, head_dim 128, bfloat16; paged decode at batch 64, context 4096, page size 16; ragged
paged attention on a mixed step (32 decode rows at context 2048 plus one 256-token prefill
chunk ending at 2048, one call; GB/s counts each row's live K/V once). On the
CPU the kernels run in interpret mode at small sizes, float32, both lowerings: that only
proves they run end to end (the timings say nothing about accelerator speed), and the table
says so.

Reports the median time, achieved TFLOP/s for flash (causal: 4*B*H*S*S*D/2 FLOPs) and GB/s
for paged decode (bytes of K/V in the live contexts, each read once), and the largest
difference from the reference, so a first run on new hardware is also a correctness check.

``--native-cpu`` runs only the CPU section instead: the native C++ paged-attention kernel
(pallas_kernels/native.py, through XLA FFI) against today's XLA path on the CPU
(``reference.attention(..., mode="decode")``, the chunked online-softmax loop), decode at rows
1/8/16/32/64 x contexts 512/1000/2048, 8 query heads over 4 KV heads, page size 16, float32,
head_dim 32 (the shipped model) and 64/128. The KV pool is larger than the last-level cache,
each row's pages are scattered (random page order), and consecutive calls use disjoint sets of
pages covering more than 3x the last-level cache, so every call reads its KV from memory.

The grid is measured in --reps passes (default 11), the cells in a new random order each pass,
so that a slow spell of a shared host's memory (they last seconds) spreads over every cell
instead of ruining a few. Right before each cell's timings in each pass the bench measures this
host's streaming read bandwidth (a jitted sum over a 256 MB float32 array, best of 3), and a
cell's fraction of the stream is the median over passes of its rate divided by that read (the
fraction of the run's median stream is printed beside it). Native and XLA are each timed as a decode
step runs them: 8 calls (one per layer of the bench model) inside one jitted fori_loop, each on
its own set of pages and each call's output fed into the next call's queries, the time divided
by 8, so no Python dispatch, host round trip or wake-up of idle pool threads sits between
calls. Beside it, "native, one call":
a single jitted call timed from Python, which pays all of those (0.1-0.3 ms on this VM).
Reported: median ms, GB/s of live KV (K and V of the live contexts, each read once), that as a
fraction of the streaming bandwidth, and the speedup native/XLA (both in the loop).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform as host_platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.runner import host_memory  # noqa: E402
from jaxserve.tools.kv_math_cli import bandwidth_probe  # noqa: E402
from pallas_kernels import reference  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.paged_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402


@dataclasses.dataclass
class Row:
    kernel: str
    config: str
    impl: str
    median_ms: float
    tflops: float | None
    gbps: float | None
    max_abs_diff: float | None


def median_ms(fn, *args, reps: int) -> float:
    """Median wall time of a jitted call after one compile-and-warm call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def bench_flash(cases, backends, dtype, interpret, reps) -> list[Row]:
    rows = []
    for b, s, h, kvh, d in cases:
        key = jax.random.split(jax.random.PRNGKey(b * s), 3)
        q = jax.random.normal(key[0], (b, s, h, d), dtype)
        k = jax.random.normal(key[1], (b, s, kvh, d), dtype)
        v = jax.random.normal(key[2], (b, s, kvh, d), dtype)
        scale = 1 / math.sqrt(d)
        flops = 4 * b * h * s * s * d / 2
        cfg = f"B={b} S={s} H={h}/{kvh} D={d} {jnp.dtype(dtype).name}"
        ref_fn = jax.jit(lambda q, k, v: reference.causal_attention(q, k, v, scale))
        want = ref_fn(q, k, v)
        impls = {
            f"pallas-{be}": jax.jit(functools.partial(flash_attention, scale=scale, backend=be, interpret=interpret))
            for be in backends
        }
        impls["reference (jnp)"] = ref_fn
        impls["jax.nn.dot_product_attention"] = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True)
        )
        for name, fn in impls.items():
            try:
                ms = median_ms(fn, q, k, v, reps=reps)
                diff = max_diff(fn(q, k, v), want)
            except Exception as e:  # e.g. an implementation the platform lacks
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            rows.append(Row("flash (causal prefill)", cfg, name, ms, flops / ms / 1e9, None, diff))
            print(f"  {rows[-1]}", file=sys.stderr)
    return rows


def xla_decode(q, kp, vp, bt, lens, *, scale):
    """Decode (q [B, H, D], one query per row at position lens-1) through the XLA serving path."""
    pos = lens[:, None] - 1
    meta = reference.AttentionMetadata(
        slot_mapping=jnp.zeros_like(pos),
        block_tables=bt,
        context_lens=lens,
        positions=pos,
        segment_ids=jnp.zeros_like(pos),
    )
    return reference.attention(q[:, None], None, None, (kp, vp), meta, scale=scale, mode="decode")[:, 0]


def bench_paged(cases, backends, dtype, interpret, reps) -> list[Row]:
    rows = []
    for b, ctx, ps, h, kvh, d in cases:
        pages_per_seq = ctx // ps
        num_pages = b * pages_per_seq + 1
        key = jax.random.split(jax.random.PRNGKey(ctx), 4)
        q = jax.random.normal(key[0], (b, h, d), dtype)
        kp = jax.random.normal(key[1], (num_pages, ps, kvh, d), dtype)
        vp = jax.random.normal(key[2], (num_pages, ps, kvh, d), dtype)
        # Shuffled pages, as a long-running server's pool would be; page 0 is the dummy.
        bt = (1 + jax.random.permutation(key[3], num_pages - 1)).reshape(b, pages_per_seq).astype(jnp.int32)
        lens = jnp.full((b,), ctx, jnp.int32)
        scale = 1 / math.sqrt(d)
        nbytes = 2 * b * ctx * kvh * d * jnp.dtype(dtype).itemsize
        cfg = f"B={b} ctx={ctx} page={ps} H={h}/{kvh} D={d} {jnp.dtype(dtype).name}"
        oracle = jax.jit(
            lambda q, kp, vp, bt, lens: reference.paged_attention(
                q[:, None], kp, vp, bt, lens, lens[:, None] - 1, scale
            )[:, 0]
        )
        want = oracle(q, kp, vp, bt, lens)
        impls = {
            f"pallas-{be}": jax.jit(
                functools.partial(paged_decode_attention, scale=scale, backend=be, interpret=interpret)
            )
            for be in backends
        }
        impls["reference gather (jnp)"] = oracle
        impls["reference serving path (XLA)"] = jax.jit(functools.partial(xla_decode, scale=scale))
        # Dense attention over an already contiguous cache: what paging costs, gather excluded.
        kc = reference.gather_pages(kp, bt)
        vc = reference.gather_pages(vp, bt)
        dense = jax.jit(lambda q, kc, vc: jax.nn.dot_product_attention(q[:, None], kc, vc, scale=scale)[:, 0])
        for name, fn in impls.items():
            try:
                ms = median_ms(fn, q, kp, vp, bt, lens, reps=reps)
                diff = max_diff(fn(q, kp, vp, bt, lens), want)
            except Exception as e:
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            rows.append(Row("paged decode", cfg, name, ms, None, nbytes / ms / 1e6, diff))
            print(f"  {rows[-1]}", file=sys.stderr)
        try:
            ms = median_ms(dense, q, kc, vc, reps=reps)
            rows.append(
                Row(
                    "paged decode",
                    cfg,
                    "jax.nn.dot_product_attention (contiguous)",
                    ms,
                    None,
                    nbytes / ms / 1e6,
                    max_diff(dense(q, kc, vc), want),
                )
            )
        except Exception as e:
            print(f"  dense {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return rows


def bench_ragged(cases, backends, dtype, interpret, reps) -> list[Row]:
    """One mixed ragged step per case: `decode` rows of one token at context `ctx`, then one
    prefill chunk of `chunk` tokens ending at `ctx`; against the jnp oracle."""
    rows = []
    for decode, chunk, ctx, ps, h, kvh, d in cases:
        r = decode + 1
        pages_per_seq = ctx // ps
        num_pages = r * pages_per_seq + 1
        key = jax.random.split(jax.random.PRNGKey(ctx + chunk), 4)
        n = decode + chunk
        q = jax.random.normal(key[0], (n, h, d), dtype)
        kp = jax.random.normal(key[1], (num_pages, ps, kvh, d), dtype)
        vp = jax.random.normal(key[2], (num_pages, ps, kvh, d), dtype)
        bt = (1 + jax.random.permutation(key[3], num_pages - 1)).reshape(r, pages_per_seq).astype(jnp.int32)
        qsl = jnp.asarray(list(range(decode + 1)) + [n], jnp.int32)
        lens = jnp.full((r,), ctx, jnp.int32)
        pos = jnp.concatenate([jnp.full((decode,), ctx - 1), ctx - chunk + jnp.arange(chunk)]).astype(jnp.int32)
        scale = 1 / math.sqrt(d)
        nbytes = 2 * r * ctx * kvh * d * jnp.dtype(dtype).itemsize
        cfg = f"{decode} decode + 1 chunk of {chunk}, ctx={ctx} page={ps} H={h}/{kvh} D={d} {jnp.dtype(dtype).name}"
        args = (q, kp, vp, qsl, lens, bt, pos)
        oracle = jax.jit(functools.partial(reference.ragged_paged_attention, scale=scale))
        want = oracle(*args)
        impls = {
            f"pallas-{be}": jax.jit(
                functools.partial(ragged_paged_attention, scale=scale, backend=be, interpret=interpret)
            )
            for be in backends
        }
        impls["reference gather (jnp)"] = oracle
        for name, fn in impls.items():
            try:
                ms = median_ms(fn, *args, reps=reps)
                diff = max_diff(fn(*args), want)
            except Exception as e:
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            rows.append(Row("ragged paged (mixed step)", cfg, name, ms, None, nbytes / ms / 1e6, diff))
            print(f"  {rows[-1]}", file=sys.stderr)
    return rows


# -- CPU: the native FFI kernel against the XLA path -------------------------------------------


@dataclasses.dataclass
class NativeRow:
    head_dim: int
    rows: int
    context: int
    native_ms: float  # per call, inside a jitted loop of calls
    native_one_ms: float  # one jitted call on its own, waited for
    xla_ms: float
    native_gbps: float
    xla_gbps: float
    native_frac: float  # median over passes of native GB/s / the stream read right before it
    xla_frac: float
    native_frac_of_median: float  # native GB/s / the median of every stream read of the run
    speedup: float  # XLA time / native time
    max_abs_diff: float


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host_platform.processor() or host_platform.machine()


def last_level_cache_bytes() -> int:
    for index in (3, 2):
        try:
            size = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
            return int(size.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
        except (OSError, ValueError):
            continue
    return 32 * 2**20


_LOOP = 8  # kernel calls per timed jitted loop (a decode step of the shipped bench model runs 8 layers)


def _looped(call):
    """jit of `_LOOP` calls of call(q, kp, vp, bt, lens) in a fori_loop over stacked block tables
    [_LOOP, B, P], each call's output fed into the next call's queries (so none can be skipped or
    reordered): the kernel timed as a decode step runs it, inside one XLA computation, with no
    dispatch or host round trip between calls."""

    def loop(q, kp, vp, tabs, lens):
        def body(i, q):
            return q + 1e-9 * call(q, kp, vp, tabs[i], lens)

        return jax.lax.fori_loop(0, _LOOP, body, q)

    return jax.jit(loop)


def _time_ms(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


@dataclasses.dataclass
class _Cell:
    d: int
    b: int
    ctx: int
    live: int  # bytes of K and V in the live contexts
    args: tuple  # q, k pages, v pages
    groups: list  # stacked block tables [_LOOP, B, P], disjoint pages
    lens: jax.Array
    nat: object  # one call
    nat_loop: object
    xla_loop: object
    diff: float
    native: list = dataclasses.field(default_factory=list)  # per call, inside the jitted loop
    native_one: list = dataclasses.field(default_factory=list)  # one jitted call, waited for
    xla_ms: list = dataclasses.field(default_factory=list)
    stream: list = dataclasses.field(default_factory=list)  # GB/s read right before each pass's timings


def bench_native_cpu(
    head_dims=(32, 64, 128),
    batch_rows=(1, 8, 16, 32, 64),
    contexts=(512, 1000, 2048),
    reps: int = 11,
    heads: int = 8,
    kv_heads: int = 4,
    page: int = 16,
    pool_mb: int = 512,
) -> tuple[list[float], list[NativeRow]]:
    """Every cell is measured in each of `reps` passes over the whole grid (cells in a new random
    order each pass, the streaming rate measured right before each cell), so a slow spell of this
    shared host's memory, which lasts seconds, spreads over all cells instead of ruining a few,
    and each rate is compared with a stream read taken within a second of it."""
    from pallas_kernels import native

    if not native.available():
        raise SystemExit(f"the native CPU kernels are unavailable: {native.unavailable_reason()}")
    llc = last_level_cache_bytes()
    print(f"  last-level cache {llc / 2**20:.0f} MB; kernel ISA {native.cpu_isa()}", file=sys.stderr)
    width = -(-max(contexts) // page)  # block-table width (even, as the XLA path wants)
    width += width % 2
    rng = np.random.default_rng(0)
    cells: list[_Cell] = []
    for d in head_dims:
        token_bytes = kv_heads * d * 4  # one token of K (or V), float32
        biggest = max(batch_rows) * max(contexts) * token_bytes
        num_pages = 1 + max(pool_mb * 2**20 // 2, biggest * 5 // 4) // (page * token_bytes)
        key = jax.random.split(jax.random.PRNGKey(d), 3)
        kp = jax.random.normal(key[0], (num_pages, page, kv_heads, d), jnp.float32)
        vp = jax.random.normal(key[1], (num_pages, page, kv_heads, d), jnp.float32)
        host_memory.advise_huge_pages((kp, vp))  # as the engine's pool (jaxserve/runner/host_memory.py)
        scale = 1 / math.sqrt(d)

        def nat_call(q, kp, vp, bt, lens, scale=scale):
            return native.paged_attention(q[:, None], kp, vp, bt, lens, lens[:, None] - 1, scale).squeeze(1)

        xla_call = functools.partial(xla_decode, scale=scale)
        nat, nat_loop, xla_loop = jax.jit(nat_call), _looped(nat_call), _looped(xla_call)
        for b in batch_rows:
            q = jax.random.normal(jax.random.PRNGKey(b), (b, heads, d), jnp.float32)
            for ctx in contexts:
                need = -(-ctx // page)
                live = 2 * b * ctx * token_bytes
                # Disjoint page sets, together over 3x the last-level cache (or as many as fit),
                # in groups of _LOOP (one timed loop each; reused round robin).
                n_sets = int(max(1, min(math.ceil(3 * llc / live), (num_pages - 1) // (b * need), 256)))
                n_sets = -(-n_sets // _LOOP) * _LOOP
                perm = 1 + rng.permutation(num_pages - 1)
                tables = np.zeros((n_sets, b, width), np.int32)  # padding entries -> the dummy page 0
                for i in range(n_sets):
                    j = i % max(1, (num_pages - 1) // (b * need))  # wraps only when the pool is too small
                    tables[i, :, :need] = perm[j * b * need : (j + 1) * b * need].reshape(b, need)
                groups = [jnp.asarray(tables[i : i + _LOOP]) for i in range(0, n_sets, _LOOP)]
                lens = jnp.full((b,), ctx, jnp.int32)
                bt0 = groups[0][0]
                diff = float(jnp.max(jnp.abs(nat(q, kp, vp, bt0, lens) - xla_call(q, kp, vp, bt0, lens))))
                for fn in (nat_loop, xla_loop):  # compile
                    jax.block_until_ready(fn(q, kp, vp, groups[0], lens))
                cells.append(_Cell(d, b, ctx, live, (q, kp, vp), groups, lens, nat, nat_loop, xla_loop, diff))
    probe = bandwidth_probe()  # 256 MB, best of 3, ~40 ms: read right before each cell
    for rep in range(reps):
        print(f"  pass {rep + 1}/{reps}", file=sys.stderr)
        for i in rng.permutation(len(cells)):
            c = cells[i]
            q, kp, vp = c.args
            g = len(c.groups)
            c.stream.append(probe() / 1e9)  # also pushes the last cell's pages out of the cache
            order = ("native", "xla") if rep % 2 == 0 else ("xla", "native")
            for k, which in enumerate(order):
                loop = c.nat_loop if which == "native" else c.xla_loop
                ms = _time_ms(loop, q, kp, vp, c.groups[(2 * rep + k) % g], c.lens) / _LOOP
                (c.native if which == "native" else c.xla_ms).append(ms)
            # One call on its own, as a caller outside jit sees it (dispatch, pool wake-up, wait).
            c.native_one.append(_time_ms(c.nat, q, kp, vp, c.groups[(2 * rep + 1) % g][-1], c.lens))
    streams = [s for c in cells for s in c.stream]
    bw = statistics.median(streams)
    out = []
    for c in cells:
        n_ms, x_ms = statistics.median(c.native), statistics.median(c.xla_ms)
        print(f"  D={c.d} rows={c.b} ctx={c.ctx}: native {n_ms:.3f} ms, XLA {x_ms:.3f} ms", file=sys.stderr)
        gbps = lambda ms: c.live / ms / 1e6  # noqa: E731
        out.append(
            NativeRow(
                c.d,
                c.b,
                c.ctx,
                n_ms,
                statistics.median(c.native_one),
                x_ms,
                gbps(n_ms),
                gbps(x_ms),
                statistics.median(gbps(t) / s for t, s in zip(c.native, c.stream)),
                statistics.median(gbps(t) / s for t, s in zip(c.xla_ms, c.stream)),
                gbps(n_ms) / bw,
                x_ms / n_ms,
                c.diff,
            )
        )
    return streams, out


def native_markdown(streams: list[float], rows: list[NativeRow]) -> str:
    q = statistics.quantiles(streams, n=10)
    out = [
        f"Streaming read bandwidth, measured right before each cell in each pass ({len(streams)} reads): median "
        f"**{statistics.median(streams):.1f} GB/s** (p10 {q[0]:.1f}, p90 {q[-1]:.1f}, best {max(streams):.1f}). "
        '"/ stream" is the median over passes of the cell\'s rate divided by the stream read just before it; '
        "\"/ median stream\" divides the cell's median rate by the run's median stream. Decode, 8 query heads over "
        "4 KV heads, page size 16, float32, KV read from memory (pages scattered, pool > last-level cache).",
        "",
        "| head_dim | rows | context | native ms | native, one call ms | XLA ms | native GB/s | native / stream | "
        "native / median stream | XLA GB/s | XLA / stream | speedup | max abs diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r.head_dim} | {r.rows} | {r.context} | {r.native_ms:.3f} | {r.native_one_ms:.3f} | {r.xla_ms:.3f} | "
            f"{r.native_gbps:.1f} | {r.native_frac:.2f} | {r.native_frac_of_median:.2f} | {r.xla_gbps:.1f} | "
            f"{r.xla_frac:.2f} | {r.speedup:.1f}x | {r.max_abs_diff:.1e} |"
        )
    return "\n".join(out)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main_native_cpu(args) -> int:
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        kw = {
            "head_dims": _ints(args.native_head_dims),
            "batch_rows": _ints(args.native_rows),
            "contexts": _ints(args.native_contexts),
        }
        if args.reps:
            kw["reps"] = args.reps
        print(f"jax {jax.__version__}, CPU: {cpu_name()}, {os.cpu_count()} cores", file=sys.stderr)
        streams, rows = bench_native_cpu(**kw)
    print(
        f"\n**CPU: native FFI paged attention vs the XLA path** (jax {jax.__version__}, {cpu_name()}, "
        f"{os.cpu_count()} cores, {kw.get('reps', 11)} passes; per call in jitted loops of {_LOOP})\n"
    )
    print(native_markdown(streams, rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "jax": jax.__version__,
                    "platform": "cpu",
                    "cpu": cpu_name(),
                    "cores": os.cpu_count(),
                    "stream_read_gbps": streams,
                    "results": [dataclasses.asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    return 0


def markdown(rows: list[Row]) -> str:
    fmt = lambda x, spec: "" if x is None else format(x, spec)
    out = [
        "| kernel | config | implementation | median ms | TFLOP/s | GB/s | max abs diff vs reference |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r.kernel} | {r.config} | {r.impl} | {r.median_ms:.3f} | {fmt(r.tflops, '.2f')} | "
            f"{fmt(r.gbps, '.1f')} | {fmt(r.max_abs_diff, '.2e')} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--backend", choices=["tpu", "gpu"], help="kernel lowering (default: the platform's; both on CPU)")
    ap.add_argument("--reps", type=int, help="timed calls per measurement (default 20, 3 on CPU; 11 native CPU)")
    ap.add_argument(
        "--native-cpu",
        action="store_true",
        help="only the CPU section: the native FFI paged-attention kernel vs the XLA path",
    )
    ap.add_argument("--native-head-dims", default="32,64,128", help="head dims for --native-cpu (comma list)")
    ap.add_argument("--native-rows", default="1,8,16,32,64", help="decode rows for --native-cpu (comma list)")
    ap.add_argument("--native-contexts", default="512,1000,2048", help="context lengths for --native-cpu")
    args = ap.parse_args(argv)
    if args.native_cpu:
        return main_native_cpu(args)

    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    device = jax.devices()[0].device_kind
    if on_cpu:
        backends = [args.backend] if args.backend else ["tpu", "gpu"]
        dtype, reps, interpret = jnp.float32, args.reps or 3, True
        flash_cases = [(1, 128, 4, 2, 64), (2, 256, 4, 2, 64)]
        paged_cases = [(4, 256, 16, 4, 2, 64)]
        ragged_cases = [(4, 40, 256, 16, 4, 2, 64)]
    else:
        backends = [args.backend or ("gpu" if platform in ("gpu", "cuda", "rocm") else "tpu")]
        dtype, reps, interpret = jnp.bfloat16, args.reps or 20, False
        flash_cases = [(b, s, 32, 8, 128) for b in (1, 2, 4) for s in (1024, 2048, 4096)]
        paged_cases = [(64, 4096, 16, 32, 8, 128)]
        ragged_cases = [(32, 256, 2048, 16, 32, 8, 128)]
    note = (
        "CPU: the kernels run in INTERPRET mode at small sizes, float32. These numbers only show that "
        "they run; they say nothing about GPU/TPU performance."
        if on_cpu
        else f"{device}: compiled kernels, bfloat16."
    )
    print(f"jax {jax.__version__}, platform {platform} ({device}). {note}", file=sys.stderr)
    rows = bench_flash(flash_cases, backends, dtype, interpret, reps)
    rows += bench_paged(paged_cases, backends, dtype, interpret, reps)
    rows += bench_ragged(ragged_cases, backends, dtype, interpret, reps)
    print(f"\n**{note}** jax {jax.__version__}, {device}, median of {reps} calls.\n")
    print(markdown(rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "jax": jax.__version__,
                    "platform": platform,
                    "device": device,
                    "interpret": interpret,
                    "reps": reps,
                    "note": note,
                    "results": [dataclasses.asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
