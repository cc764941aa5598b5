"""Time the Pallas attention kernels against the jnp reference and jax.nn.dot_product_attention.

    python scripts/bench_kernels.py [--json results.json] [--backend tpu|gpu] [--reps N]

On a GPU or TPU: flash attention at B=1,2,4 x seq 1024/2048/4096, 32 query heads over 8 KV
heads, head_dim 128, bfloat16; paged decode at batch 64, context 4096, page size 16. On the
CPU the kernels run in interpret mode at small sizes, float32, both lowerings: that only
proves they run end to end (the timings say nothing about accelerator speed), and the table
says so.

Reports the median time, achieved TFLOP/s for flash (causal: 4*B*H*S*S*D/2 FLOPs) and GB/s
for paged decode (bytes of K/V in the live contexts, each read once), and the largest
difference from the reference, so a first run on new hardware is also a correctness check.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import reference  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.paged_attention import paged_decode_attention  # noqa: E402


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
        impls = {f"pallas-{be}": jax.jit(functools.partial(flash_attention, scale=scale, backend=be,
                                                           interpret=interpret)) for be in backends}
        impls["reference (jnp)"] = ref_fn
        impls["jax.nn.dot_product_attention"] = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True))
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
        oracle = jax.jit(lambda q, kp, vp, bt, lens: reference.paged_attention(
            q[:, None], kp, vp, bt, lens, lens[:, None] - 1, scale)[:, 0])
        want = oracle(q, kp, vp, bt, lens)
        impls = {f"pallas-{be}": jax.jit(functools.partial(paged_decode_attention, scale=scale, backend=be,
                                                           interpret=interpret)) for be in backends}
        impls["reference gather (jnp)"] = oracle
        impls["reference serving path (XLA)"] = jax.jit(lambda q, kp, vp, bt, lens: reference.attention(
            q[:, None], None, None, kp, vp, bt, lens, lens[:, None] - 1, None, scale, mode="decode")[:, 0])
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
            rows.append(Row("paged decode", cfg, "jax.nn.dot_product_attention (contiguous)", ms, None,
                            nbytes / ms / 1e6, max_diff(dense(q, kc, vc), want)))
        except Exception as e:
            print(f"  dense {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return rows


def markdown(rows: list[Row]) -> str:
    fmt = lambda x, spec: "" if x is None else format(x, spec)
    out = ["| kernel | config | implementation | median ms | TFLOP/s | GB/s | max abs diff vs reference |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r.kernel} | {r.config} | {r.impl} | {r.median_ms:.3f} | {fmt(r.tflops, '.2f')} | "
                   f"{fmt(r.gbps, '.1f')} | {fmt(r.max_abs_diff, '.2e')} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--backend", choices=["tpu", "gpu"], help="kernel lowering (default: the platform's; both on CPU)")
    ap.add_argument("--reps", type=int, help="timed calls per measurement (default 20, 3 on CPU)")
    args = ap.parse_args(argv)

    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    device = jax.devices()[0].device_kind
    if on_cpu:
        backends = [args.backend] if args.backend else ["tpu", "gpu"]
        dtype, reps, interpret = jnp.float32, args.reps or 3, True
        flash_cases = [(1, 128, 4, 2, 64), (2, 256, 4, 2, 64)]
        paged_cases = [(4, 256, 16, 4, 2, 64)]
    else:
        backends = [args.backend or ("gpu" if platform in ("gpu", "cuda", "rocm") else "tpu")]
        dtype, reps, interpret = jnp.bfloat16, args.reps or 20, False
        flash_cases = [(b, s, 32, 8, 128) for b in (1, 2, 4) for s in (1024, 2048, 4096)]
        paged_cases = [(64, 4096, 16, 32, 8, 128)]
    note = ("CPU: the kernels run in INTERPRET mode at small sizes, float32. These numbers only show that "
            "they run; they say nothing about GPU/TPU performance." if on_cpu else
            f"{device}: compiled kernels, bfloat16.")
    print(f"jax {jax.__version__}, platform {platform} ({device}). {note}", file=sys.stderr)
    rows = bench_flash(flash_cases, backends, dtype, interpret, reps)
    rows += bench_paged(paged_cases, backends, dtype, interpret, reps)
    print(f"\n**{note}** jax {jax.__version__}, {device}, median of {reps} calls.\n")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"jax": jax.__version__, "platform": platform, "device": device,
                                         "interpret": interpret, "reps": reps, "note": note,
                                         "results": [dataclasses.asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
