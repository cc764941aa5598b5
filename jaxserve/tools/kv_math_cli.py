"""``jaxserve kv-math``: the calculator's command line, its plot, and measurements of this
host (bandwidth, matmul rate, the real engine step) that check the predictions.

The math itself is ``jaxserve.kv_math`` (a pure library the engine imports); this module is
a tool at the top of the stack, so it may build an engine to time it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from jaxserve import kv_math
from jaxserve.kv_math import (
    ACCELERATORS,
    DEFAULT_ACTIVATION_RESERVE_FRACTION,
    DEFAULT_PAGE_SIZE,
    DTYPE_BYTES,
    GB,
    PRESETS,
    WEIGHT_ONLY_DTYPES,
    ModelShape,
    Plan,
    _ms,
    _positive_int,
    decode_step_bounds,
    plan,
    predict_decode_step,
    resolve_model,
)


def write_plot(p: Plan, path: str | Path) -> None:
    """Tokens/s and cost against batch size: shows where batching stops paying and where memory ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    top = max(2, p.max_concurrent_requests)
    batches = np.unique(np.geomspace(1, top * 1.5, 60).astype(int))
    stats = [p.at_batch(int(b)) for b in batches]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(batches, [s[1] for s in stats])
    ax1.set(xlabel="batch (concurrent requests)", ylabel="tokens/s ceiling", xscale="log")
    ax2.plot(batches, [s[2] if s[2] is not None else np.nan for s in stats])
    ax2.set(xlabel="batch (concurrent requests)", ylabel="USD per 1M output tokens", xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.axvline(p.max_concurrent_requests, color="red", ls="--", label=f"max batch {p.max_concurrent_requests}")
        ax.axvspan(p.max_concurrent_requests, batches[-1], color="grey", alpha=0.15, label="KV does not fit")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{p.model} on {p.num_chips} x {p.accelerator}, {p.context_len:,}-token context, "
        f"weights {p.weight_dtype}, KV {p.kv_dtype}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- host measurement
def measure_host(
    size_bytes: int = 512 * 1024 * 1024, repeats: int = 5, matmul_dtype: str = "float32"
) -> dict[str, float]:
    """Measure the bandwidth and FLOP/s that predict_decode_step needs, on this machine.

    Bandwidth is the faster of a numpy sum (one core) and a jitted jax sum (all cores),
    since the engine streams weights through XLA; best of ``repeats`` runs. The matmul rate
    (512 x 4096 x 4096) is XLA's float32 dot; with ``matmul_dtype="bfloat16"`` (where the native
    bfloat16 matmul runs) also the native kernel on bfloat16 panels, and ``matmul_flops`` is the
    rate of the requested dtype: a step computing in bfloat16 is bounded by that rate, not by
    float32's.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runner import host_memory

    def best(fn: Any) -> float:
        fn()  # warm-up: page faults, compilation
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    start = time.perf_counter()
    x = jnp.ones(size_bytes // 4, jnp.float32)  # allocating once: page faults cost seconds on a small VM
    host_memory.advise_huge_pages(x)  # mapped as the engine maps its weights and pool
    a = np.asarray(x)  # a zero-copy view on the CPU backend
    bw_numpy = a.nbytes / best(a.sum)
    jsum = jax.jit(jnp.sum)
    bw_jax = x.nbytes / best(lambda x=x: jsum(x).block_until_ready())
    del a, x
    lhs, rhs = jnp.ones((512, 4096), jnp.float32), jnp.ones((4096, 4096), jnp.float32)
    mm = jax.jit(jnp.matmul)
    flops = 2 * 512 * 4096 * 4096 / best(lambda: mm(lhs, rhs).block_until_ready())
    out = {
        "memory_bandwidth": max(bw_numpy, bw_jax),
        "memory_bandwidth_numpy": bw_numpy,
        "memory_bandwidth_jax": bw_jax,
        "matmul_flops_fp32": flops,
        "matmul_flops": flops,
    }
    from pallas_kernels import native_matmul

    if matmul_dtype == "bfloat16" and native_matmul.bf16_available():
        mm16, panels = _bf16_square()
        out["matmul_flops_bf16"] = out["matmul_flops"] = (
            2 * 512 * 4096 * 4096 / best(lambda: mm16(lhs, panels).block_until_ready())
        )
    return {**out, "seconds": time.perf_counter() - start}


@functools.cache
def _bf16_square():
    """measure_host's bfloat16 matmul and its 4096 x 4096 panels, packed once per process (every
    round of --measure-host measures again; packing 16M weights again each time is ~0.3 s)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import native_matmul

    panels = jnp.asarray(native_matmul.pack_bf16(np.ones((4096, 4096), np.float32)))
    return jax.jit(lambda x, w: native_matmul.matmul(x, w, n=4096)), panels


def bandwidth_probe(size_bytes: int | None = None, repeats: int = 3):
    """A function returning this host's streaming read rate now (bytes/s: a jitted jax sum over
    an array allocated once, best of `repeats`), cheap enough (~40 ms) to call right before
    each timing, so that a step is compared with the memory speed of the same second.
    Default size: 256 MiB on the CPU; 4 GiB on an accelerator, where 256 MiB is read in tens of
    microseconds and the launch would count (an H200 read 1.1 TB/s of 256 MiB)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runner import host_memory

    if size_bytes is None:
        size_bytes = (256 << 20) if jax.default_backend() == "cpu" else (4 << 30)
    x = jnp.ones(size_bytes // 4, jnp.float32)
    host_memory.advise_huge_pages(x)
    jsum = jax.jit(jnp.sum)
    jsum(x).block_until_ready()

    def rate() -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            jsum(x).block_until_ready()
            best = min(best, time.perf_counter() - t)
        return x.nbytes / best

    return rate


def decode_step_runner(
    model: ModelShape,
    batch: int,
    context_len: int,
    *,
    attention_impl: str | None = None,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    matmul_impl: str | None = None,
    matmul_dtype: str = "float32",
):
    """A ModelRunner for a random-weight model of this shape (float32; the engine's default
    attention for this backend unless `attention_impl`; KV pages in float32 or `kv_cache_dtype`;
    weights in float32, or int8 with `quantization`, or bfloat16 (AMX / AVX512-BF16) with
    matmul_dtype="bfloat16") and its decode rows: `batch` slots, each at
    `context_len` tokens on its own pages. Returns (runner, rows); `runner.decode(rows, 0)` is
    one step. The step kv-math predicts."""
    from flax import nnx

    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.models.llama import LlamaForCausalLM
    from jaxserve.models.model_config import ModelConfig
    from jaxserve.runner import model_runner, runner_config
    from jaxserve.runner.step_batch import GREEDY, Chunk

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max(context_len + 1, 16),
        tie_word_embeddings=model.tie_word_embeddings,
    )
    ps = 16
    pages = -(-(context_len + 1) // ps)
    engine_cfg = EngineConfig(
        max_slots=batch,
        page_size=ps,
        max_model_len=pages * ps,
        num_pages=batch * pages + 1,
        dtype="float32",
        attention_impl=attention_impl,
        kv_cache_dtype=kv_cache_dtype,
        matmul_impl=matmul_impl,
        matmul_dtype=matmul_dtype if matmul_impl != "xla" else None,
        enable_prefix_caching=False,
    )
    rc = runner_config.resolve(cfg, None, engine_cfg, weight_bytes=0, max_logprobs=0)
    module = LlamaForCausalLM(cfg, dtype="float32", rngs=nnx.Rngs(0))
    if quantization is not None:
        from jaxserve.models.linear import quantize_modules

        quantize_modules(module, quantization)
    rows = [Chunk([0], context_len, list(range(1 + i * pages, 1 + (i + 1) * pages)), GREEDY) for i in range(batch)]
    runner = model_runner.ModelRunner(module, cfg, rc)
    runner.wait_for_huge_pages()  # timed steps start on huge pages, as after an engine's warm-up
    return runner, rows


def time_decode_steps(runner, rows, repeats: int) -> float:
    """Median seconds of `repeats` decode steps of a compiled `decode_step_runner`, each waited for
    before the next is built: the step with its host work (building the batch, reading the tokens
    back) in series."""
    import jax

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.decode(rows, 0)
        jax.block_until_ready(runner.kv)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_overlapped_steps(runner, rows, repeats: int) -> float:
    """Median seconds per decode step as the engine runs them (async scheduling): each step is
    dispatched, fed its tokens from the previous step on the device, before the previous step's
    tokens are read back, so the host's work for one step overlaps the device's for the other.
    A step's time is the interval between consecutive read-backs, in steady state."""
    feed = list(range(len(rows)))  # row i reads the token the previous step sampled for row i
    pending = runner.step_async(rows)
    times = []
    last = None
    for _ in range(repeats + 1):  # the first interval starts from a step dispatched alone
        nxt = runner.step_async(rows, False, feed)
        pending.result()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last, pending = now, nxt
    pending.result()
    return statistics.median(times)


def measure_engine_step(
    model: ModelShape,
    batch: int,
    context_len: int,
    repeats: int = 5,
    attention_impl: str | None = None,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    matmul_impl: str | None = None,
) -> float:
    """Median seconds of the real jaxserve decode step of `decode_step_runner`: the number the
    roofline predicts."""
    runner, rows = decode_step_runner(
        model,
        batch,
        context_len,
        attention_impl=attention_impl,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        matmul_impl=matmul_impl,
    )
    runner.decode(rows, 0)  # compile
    return time_decode_steps(runner, rows, repeats)


def _measure_host_report(
    model: ModelShape,
    context_len: int,
    as_json: bool,
    kv_dtype: str = "fp32",
    weight_dtype: str = "fp32",
    rounds: int = 5,
    repeats: int = 5,
) -> int:
    """kv_dtype: fp32, bf16 (the engine's default pages where it computes in bfloat16), or int8 /
    fp8 (the engine's kv_cache_dtype, scales counted);
    weight_dtype: fp32, int8 (the engine's quantization="int8") or bf16 (matmul_dtype="bfloat16",
    the engine's default where the CPU has AMX or AVX512-BF16; elsewhere fp32 is measured and said so).

    A shared host's memory speed swings by 2x within seconds, so one bandwidth reading followed
    by the steps can put any ratio anywhere. Instead every step is compiled first, then `rounds`
    rounds each measure the host (`measure_host`: the bandwidth and matmul rate reported) and
    time every step (`repeats` each, median), each timing right after a short bandwidth read
    (`bandwidth_probe`); a timing's ratio is to its bound at that read's bandwidth (and the
    round's matmul rate), and the median over rounds is reported, with the median step and the
    bound at the median bandwidth beside it."""
    kv_cache_dtype = {"int8": "int8", "fp8": "fp8", "bf16": "bfloat16"}.get(kv_dtype, "auto")
    kv_dtype = kv_dtype if kv_cache_dtype != "auto" else "fp32"
    from pallas_kernels import native_matmul

    quantization = "int8" if weight_dtype == "int8" else None
    if weight_dtype == "bf16" and not native_matmul.bf16_available():
        print(
            f"bf16 weights need the native matmul on AVX2 or better ({native_matmul.bf16_unavailable_reason()}): measuring fp32"
        )
        weight_dtype = "fp32"
    weight_dtype = "int8" if quantization else weight_dtype if weight_dtype == "bf16" else "fp32"
    matmul_dtype = "bfloat16" if weight_dtype == "bf16" else "float32"
    batches = (1, 8, 32)
    impls = {"engine": {"matmul_dtype": matmul_dtype}, "xla": {"attention_impl": "xla", "matmul_impl": "xla"}}
    runners = {}
    for b in batches:
        for name, kw in impls.items():
            runner, rows = decode_step_runner(
                model, b, context_len, kv_cache_dtype=kv_cache_dtype, quantization=quantization, **kw
            )
            runner.decode(rows, 0)  # compile
            runners[b, name] = (runner, rows)
    hosts, steps = [], {key: [] for key in [*runners, *((b, "waited") for b in batches)]}
    near = {key: [] for key in steps}  # (bandwidth read right before the timing, its round's host)
    probe = bandwidth_probe()
    for _ in range(rounds):
        h = measure_host(matmul_dtype=matmul_dtype)
        hosts.append(h)
        for (b, name), (runner, rows) in runners.items():
            near[b, name].append({**h, "memory_bandwidth": probe()})
            steps[b, name].append(time_overlapped_steps(runner, rows, repeats))
            if name == "engine":
                near[b, "waited"].append({**h, "memory_bandwidth": probe()})
                steps[b, "waited"].append(time_decode_steps(runner, rows, repeats))
    host = {
        k: statistics.median(h[k] for h in hosts)
        for k in (
            "memory_bandwidth",
            "memory_bandwidth_numpy",
            "memory_bandwidth_jax",
            "matmul_flops_fp32",
            "matmul_flops",
        )
    }
    host["seconds"] = sum(h["seconds"] for h in hosts)
    host["memory_bandwidth_rounds"] = [h["memory_bandwidth"] for h in hosts]
    host["memory_bandwidth_near_steps"] = [h["memory_bandwidth"] for hs in near.values() for h in hs]

    def bounds(b: int, h: dict) -> tuple[float, float]:
        return decode_step_bounds(
            model,
            b,
            context_len,
            h["memory_bandwidth"],
            h["matmul_flops"],
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
        )

    rows = []
    for b in batches:
        mem, comp = bounds(b, host)

        def phases(h: dict) -> float:
            bw, peak = h["memory_bandwidth"], h["matmul_flops"]
            return predict_decode_step(model, b, context_len, bw, peak, weight_dtype, kv_dtype, phases=True)

        def ratio(key: tuple, bound=lambda h: max(bounds(b, h))) -> float:
            """Each timing against the bound at the bandwidth read just before it."""
            return statistics.median(t / bound(h) for t, h in zip(steps[key], near[key]))

        row = {
            "batch": b,
            "memory_bound_s": mem,
            "compute_bound_s": comp,
            "predicted_s": max(mem, comp),
            "predicted_phases_s": phases(host),
            "measured_engine_s": statistics.median(steps[b, "engine"]),
            "measured_engine_waited_s": statistics.median(steps[b, "waited"]),
            "measured_engine_xla_s": statistics.median(steps[b, "xla"]),
        }
        row["measured_over_predicted"] = ratio((b, "engine"))
        row["measured_over_phases"] = ratio((b, "engine"), phases)
        row["waited_over_predicted"] = ratio((b, "waited"))
        row["xla_over_predicted"] = ratio((b, "xla"))
        rows.append(row)
    if as_json:
        out = {
            "host": host,
            "model": model.name,
            "context_len": context_len,
            "kv_dtype": kv_dtype,
            "weight_dtype": weight_dtype,
            "rounds": rounds,
            "steps": rows,
            # every timing with the bandwidth read just before it: what each ratio is made of
            "timings": {
                f"batch {b} {name}": [
                    {"step_s": t, "memory_bandwidth": h["memory_bandwidth"]}
                    for t, h in zip(steps[b, name], near[b, name])
                ]
                for b, name in steps
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    seen = ", ".join(f"{h['memory_bandwidth'] / GB:.1f}" for h in hosts)
    print(
        f"host: memory bandwidth {host['memory_bandwidth'] / GB:.1f} GB/s, median of {rounds} rounds ({seen}; numpy sum "
        f"{host['memory_bandwidth_numpy'] / GB:.1f}, jax sum {host['memory_bandwidth_jax'] / GB:.1f}), "
        f"fp32 matmul {host['matmul_flops_fp32'] / 1e9:.0f} GFLOP/s"
        + (
            f", bf16 matmul {host['matmul_flops'] / 1e9:.0f} GFLOP/s (the compute bound)"
            if matmul_dtype == "bfloat16"
            else ""
        )
        + "; read before each timing: median "
        f"{statistics.median(host['memory_bandwidth_near_steps']) / GB:.1f}, lowest "
        f"{min(host['memory_bandwidth_near_steps']) / GB:.1f} GB/s"
    )
    print(
        f"predicted decode step ({weight_dtype} weights, {kv_dtype} KV), {model.name} ({model.num_params / 1e6:.1f}M params), "
        f"context {context_len}; steps and bounds are medians over the rounds, ratios the median of each timing's "
        "against the bandwidth read just before it:"
    )
    print(
        f"{'batch':>6} {'memory':>12} {'compute':>12} {'predicted':>12} {'engine':>12} {'ratio':>7} "
        f"{'waited':>12} {'ratio':>7} {'engine, xla':>17} {'ratio':>7} {'phases':>12} {'engine/phases':>14}"
    )
    for r in rows:
        print(
            f"{r['batch']:>6} {_ms(r['memory_bound_s']):>12} {_ms(r['compute_bound_s']):>12} "
            f"{_ms(r['predicted_s']):>12} {_ms(r['measured_engine_s']):>12} {r['measured_over_predicted']:>6.1f}x "
            f"{_ms(r['measured_engine_waited_s']):>12} {r['waited_over_predicted']:>6.1f}x "
            f"{_ms(r['measured_engine_xla_s']):>17} {r['xla_over_predicted']:>6.1f}x "
            f"{_ms(r['predicted_phases_s']):>12} {r['measured_over_phases']:>13.1f}x"
        )
    print(
        "engine: steps as the engine runs them, each dispatched before the last one's tokens are read back; "
        "waited: each step built, run and read back before the next; phases: the projections at their own "
        "roofline, max(weights, FLOPs), plus the attention's KV read (kv_math.predict_decode_step, phases=True)"
    )
    return 0


# --------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxserve kv-math", description=kv_math.__doc__.split("\n\n")[1])
    ap.add_argument(
        "--model",
        default="llama-3.1-8b",
        help=f"preset ({', '.join(PRESETS)}), checkpoint dir, config.json, GGUF file or workload JSON",
    )
    ap.add_argument("--accelerator", default="h100", help=", ".join(ACCELERATORS))
    ap.add_argument("--chips", type=int, default=1, help="chips in the tensor-parallel group")
    ap.add_argument("--kv-dtype", default="bf16", help=", ".join(d for d in DTYPE_BYTES if d not in WEIGHT_ONLY_DTYPES))
    ap.add_argument("--weight-dtype", default="bf16", help=", ".join(DTYPE_BYTES))
    ap.add_argument("--context", type=int, default=8192, help="tokens per request (prompt + output)")
    ap.add_argument("--memory-fraction", type=float, default=0.9, help="share of HBM the server may use")
    ap.add_argument(
        "--activation-reserve-gb",
        type=float,
        default=None,
        help=f"per chip, in GB (default {DEFAULT_ACTIVATION_RESERVE_FRACTION:.0%}% of HBM)",
    )
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per KV page")
    ap.add_argument("--price-per-chip-hour", type=float, default=None, help="USD (default: rough on-demand price)")
    ap.add_argument("--mean-prompt", type=float, default=None)
    ap.add_argument("--mean-output", type=float, default=None)
    ap.add_argument("--workload", metavar="FILE", default=None, help="workload JSON with a requests list")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--plot", metavar="FILE.png", default=None, help="tokens/s and cost against batch size")
    ap.add_argument(
        "--measure-host",
        action="store_true",
        help="measure this machine and predict decode steps at batch 1, 8, 32 (KV bf16 by default, or "
        "--kv-dtype fp32/int8/fp8; weights bf16 where the native bf16 matmul runs (AVX2 or better), else "
        "fp32; --weight-dtype fp32, or int8: the engine's quantization)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="--measure-host: rounds of (host measurement, every step after a bandwidth read); medians over them are reported (default 5)",
    )
    return ap


def _model_shape(spec: str) -> ModelShape:
    """kv_math.resolve_model, and a GGUF file's shape from its metadata (kv_math reads JSON
    configs only: it imports nothing of jaxserve, the GGUF reader lives with the models)."""
    from jaxserve.models import gguf

    if not gguf.is_gguf(spec):
        return resolve_model(spec)
    return gguf.read_config(spec).shape()


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 the configuration does not fit, 2 bad usage."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its message; hand back its code instead of exiting
        return int(e.code or 0)
    try:
        model = _model_shape(args.model)
        if args.measure_host:
            if args.weight_dtype not in ("bf16", "fp32", "int8"):
                raise ValueError(
                    f"weight_dtype: --measure-host runs bf16, fp32 or int8 weights, not {args.weight_dtype}"
                )
            return _measure_host_report(
                model,
                _positive_int("context_len", args.context),
                args.json,
                args.kv_dtype,
                args.weight_dtype,
                rounds=_positive_int("rounds", args.rounds),
            )
        reserve = None if args.activation_reserve_gb is None else args.activation_reserve_gb * GB
        p = plan(
            model,
            args.accelerator,
            args.chips,
            args.kv_dtype,
            args.weight_dtype,
            args.context,
            args.memory_fraction,
            reserve,
            args.page_size,
            args.price_per_chip_hour,
            args.mean_prompt,
            args.mean_output,
            args.workload,
        )
    except ValueError as e:
        print(f"jaxserve kv-math: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict(), indent=2) if args.json else p.to_text())
    if not p.fits:
        print(f"jaxserve kv-math: {p.reason}", file=sys.stderr)
        return 1
    if args.plot:
        write_plot(p, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
