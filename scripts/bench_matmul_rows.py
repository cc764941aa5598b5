"""R rows through the native matmul over every projection of the 56.4M bench model (8 layers of
qkv, o, gate_up, down, and the 512 x 32,000 LM head; random weights), float32 panels against
bfloat16 panels, alternating, each timing right after a streaming read: the time beside its
memory bound (the packed bytes over that read). Isolates the matmul's streaming rate from the
rest of a decode step (attention, norms, sampling).

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_matmul_rows.py [ROWS] [ROUNDS]
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.tools.kv_math_cli import bandwidth_probe  # noqa: E402
from pallas_kernels import native_matmul as nm  # noqa: E402

R = int(sys.argv[1]) if len(sys.argv) > 1 else 1
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
if not nm.bf16_available():
    sys.exit(f"bfloat16 matmul unavailable: {nm.bf16_unavailable_reason()}")
shapes = [(512, 1024), (512, 512), (512, 2816), (1408, 512)] * 8 + [(512, 32000)]
rng = np.random.default_rng(0)
ws = [rng.standard_normal(s).astype(np.float32) * 0.02 for s in shapes]
packs = {"f32": [jnp.asarray(nm.pack(w)) for w in ws], "bf16": [jnp.asarray(nm.pack_bf16(w)) for w in ws]}
nbytes = {k: sum(p.nbytes for p in v) for k, v in packs.items()}
xs = {k: jnp.asarray(rng.standard_normal((R, k)).astype(np.float32)) for k in (512, 1408)}


def run(panels):
    acc = 0.0
    for (k, n), p in zip(shapes, panels):
        acc = acc + nm.matmul(xs[k], p, n=n)[:, :8].sum()
    return acc


f = jax.jit(run)
for k in packs:
    f(packs[k]).block_until_ready()
probe = bandwidth_probe()
res = {k: [] for k in packs}
for r in range(rounds):
    for k in packs if r % 2 == 0 else list(packs)[::-1]:
        bw = probe()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            f(packs[k]).block_until_ready()
            ts.append(time.perf_counter() - t)
        res[k].append((min(ts), bw))
for k, v in res.items():
    t = statistics.median(x[0] for x in v)
    ratio = statistics.median(x[0] * x[1] / nbytes[k] for x in v)
    stream = statistics.median(x[1] for x in v) / 1e9
    print(
        f"{R} rows, {k} panels: {nbytes[k] / 2**20:.0f} MiB, median best-of-5 {t * 1e3:.2f} ms = {ratio:.2f}x "
        f"its memory bound ({nbytes[k] / t / 1e9:.1f} GB/s; streaming read {stream:.1f} GB/s)"
    )
