"""Time one ragged native attention call against the same work as two calls (decode rows, chunk).

    python scripts/bench_ragged.py [--rounds 15] [--calls 20]

The batch of a mixed step: 16 decode rows (contexts 950..1050) plus one fresh 256-token prompt
(context 256, positions 0..255), H=8 query heads over KVH=4, head_dim 64, page size 16, pages
scattered in the pool, float32 and bfloat16 pages (q float32). Timed, each jitted:

- ragged: ``native.ragged_paged_attention`` once over the 272 flat tokens;
- two calls: ``native.ragged_paged_attention`` on the 16 decode rows alone and on the chunk
  alone, both in one jitted function;
- decode alone / chunk alone: each of those two calls by itself;
- XLA causal: ``reference.causal_attention`` on the chunk's own k/v (how a fresh prompt is
  attended today, no pages read).

The host is shared and noisy: a round makes ``--calls`` passes, each pass calls every variant once
in a new random order (so they share the host's slow spells); printed are the median over rounds
of each round's median (and the 10th-90th percentile), and the median of the ratio ragged / two
calls over pairs of calls made side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import native, reference  # noqa: E402

H, KVH, D, PS = 8, 4, 64, 16
DECODE_ROWS, CHUNK = 16, 256


def problem(rng, dtype):
    """Pages, the index arrays of the whole batch, of its decode rows alone and of its chunk alone."""
    lens = [int(x) for x in rng.integers(950, 1051, DECODE_ROWS)] + [CHUNK]
    need = [-(-n // PS) for n in lens]
    width = max(need)
    num_pages = 1 + sum(need)
    order = rng.permutation(np.arange(1, num_pages))
    bt = np.zeros((len(lens), width), np.int32)
    used = 0
    for r, p in enumerate(need):
        bt[r, :p] = order[used : used + p]
        used += p
    k = jnp.asarray(rng.standard_normal((num_pages, PS, KVH, D), np.float32)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((num_pages, PS, KVH, D), np.float32)).astype(dtype)
    q = jnp.asarray(rng.standard_normal((DECODE_ROWS + CHUNK, H, D), np.float32))
    cl = np.asarray(lens, np.int32)
    pos = np.concatenate([cl[:DECODE_ROWS] - 1, np.arange(CHUNK)]).astype(np.int32)
    qsl = np.concatenate([np.arange(DECODE_ROWS + 1), [DECODE_ROWS + CHUNK]]).astype(np.int32)
    ragged = (q, k, v, jnp.asarray(qsl), jnp.asarray(cl), jnp.asarray(bt), jnp.asarray(pos))
    dec = (q[:DECODE_ROWS], k, v, jnp.asarray(qsl[: DECODE_ROWS + 1]), jnp.asarray(cl[:DECODE_ROWS]))
    dec = (*dec, jnp.asarray(bt[:DECODE_ROWS]), jnp.asarray(pos[:DECODE_ROWS]))
    chunk = (q[DECODE_ROWS:], k, v, jnp.asarray([0, CHUNK], jnp.int32), jnp.asarray(cl[DECODE_ROWS:]))
    chunk = (*chunk, jnp.asarray(bt[DECODE_ROWS:]), jnp.asarray(pos[DECODE_ROWS:]))
    # The chunk's own keys and values, as a fresh prompt's step has them before attention.
    flat = lambda pages: reference.gather_pages(pages, jnp.asarray(bt[DECODE_ROWS:]))[:, :CHUNK]  # noqa: E731
    fresh = (q[None, DECODE_ROWS:], flat(k), flat(v))
    return ragged, dec, chunk, fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    assert native.available(), native.unavailable_reason()
    scale = 1 / D**0.5
    ragged_f = jax.jit(lambda *a: native.ragged_paged_attention(*a, scale))
    two_f = jax.jit(lambda d, c: (native.ragged_paged_attention(*d, scale), native.ragged_paged_attention(*c, scale)))
    causal_f = jax.jit(lambda q, k, v: reference.causal_attention(q, k, v, scale))
    rng = np.random.default_rng(0)
    print(f"host isa {native.cpu_isa()}, H={H} KVH={KVH} D={D} page {PS}, {DECODE_ROWS} decode rows + {CHUNK} chunk")
    for dtype in (jnp.float32, jnp.bfloat16):
        ragged, dec, chunk, fresh = problem(rng, dtype)
        # Same result both ways (a row's result does not depend on the other rows of the call).
        r = np.asarray(ragged_f(*ragged))
        d, c = two_f(dec, chunk)
        assert np.array_equal(r[:DECODE_ROWS], np.asarray(d)) and np.array_equal(r[DECODE_ROWS:], np.asarray(c))
        variants = {
            "ragged (one call)": lambda: ragged_f(*ragged),
            "two calls": lambda: two_f(dec, chunk),
            "decode rows alone": lambda: ragged_f(*dec),
            "chunk alone": lambda: ragged_f(*chunk),
            "XLA causal (chunk)": lambda: causal_f(*fresh),
        }
        for f in variants.values():
            jax.block_until_ready(f())
        times = {name: [] for name in variants}
        ratios = []  # ragged / two calls, call by call
        for _ in range(args.rounds):
            per = {name: [] for name in variants}
            for _ in range(args.calls):
                for name in rng.permutation(list(variants)):
                    t0 = time.perf_counter()
                    jax.block_until_ready(variants[name]())
                    per[name].append(time.perf_counter() - t0)
                ratios.append(per["ragged (one call)"][-1] / per["two calls"][-1])
            for name in variants:
                times[name].append(statistics.median(per[name]) * 1e3)
        print(f"\npages {jnp.dtype(dtype).name}: median ms over {args.rounds} rounds (p10-p90)")
        for name, ts in times.items():
            q10, q90 = np.percentile(ts, [10, 90])
            print(f"  {name:20s} {statistics.median(ts):7.3f}  ({q10:.3f}-{q90:.3f})")
        q10, q90 = np.percentile(ratios, [10, 90])
        print(f"  ragged / two calls, paired call by call: {statistics.median(ratios):.3f} ({q10:.3f}-{q90:.3f})")


if __name__ == "__main__":
    main()
