"""`jaxserve bench profile`: where one decode step's time goes, op by op, as XLA ran it.

The step is the one `jaxserve kv-math --measure-host` times (kv_math_cli.decode_step_runner:
random weights of the model's shape, the engine's default attention and matmul for this
backend, `batch` rows at `context` tokens). It runs under `jax.profiler.trace`, and the trace
is read back with `jax.profiler.ProfileData`: per op (a fusion, a custom call such as the native
kernels, a conditional), its time per step summed over the threads that ran it, and its share.
An op that should be cheap and is not shows at once here, and not in `perf`, which sees only
XLA's generated code. Custom calls are named by their target (`jaxserve_matmul_f32`). The wall
time per step under the trace also pays for tracing Python: time steps with kv-math instead.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

from jaxserve.tools.bench import flags, result

_SKIP = ("ThunkExecutor", "ThreadpoolListener")  # containers of the ops, not ops


def op_kind(name: str, targets: dict[str, str]) -> str:
    """'ffi_call.124' -> its custom-call target; 'ynn_fusion.3' -> 'ynn_fusion' (XLA numbers each
    instance of an op)."""
    return targets.get(name) or name.split(".")[0]


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """{instruction name: custom_call_target} from a compiled module's text."""
    pattern = r"%([\w.-]+) = [^\n]*? custom-call\([^\n]*?custom_call_target=\"([^\"]+)\""
    return {m.group(1): m.group(2) for m in re.finditer(pattern, hlo_text)}


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """(nanoseconds, calls) per op name over the host threads of the trace."""
    import jax

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise ValueError(f"profile: no trace written under {trace_dir}")
    per_op: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for ev in line.events:
                if not ev.name.startswith(_SKIP) and not ev.name.startswith("end: "):
                    per_op[ev.name] += ev.duration_ns
                    calls[ev.name] += 1
    return per_op, calls


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxserve bench profile`'s flags."""
    p.add_argument("--model", required=True, help="a checkpoint, config.json, workload JSON, GGUF or kv-math preset "
                   "(its shape; random weights)")  # fmt: skip
    p.add_argument("--batch", type=flags.positive, default=32, help="decode rows (default 32)")
    p.add_argument("--context", type=flags.positive, default=512, help="tokens of context per row (default 512)")
    p.add_argument("--steps", type=flags.positive, default=10, help="steps traced, after 3 untraced (default 10)")
    p.add_argument("--top", type=flags.positive, default=25, help="ops listed (default 25)")
    p.add_argument("--matmul-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, int8, fp8 or bfloat16 pages")
    flags.out_flag(p)


def run(args, argv) -> dict:
    import jax

    from jaxserve.tools.kv_math_cli import _model_shape, decode_step_runner, time_decode_steps

    shape = _model_shape(args.model)  # a preset, a config or a GGUF file, as kv-math takes it
    runner, rows = decode_step_runner(
        shape, args.batch, args.context, matmul_dtype=args.matmul_dtype, kv_cache_dtype=args.kv_cache_dtype
    )
    time_decode_steps(runner, rows, 3)  # compile and warm
    with tempfile.TemporaryDirectory(prefix="jaxserve-profile-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            wall = time_decode_steps(runner, rows, args.steps)
        per_op, calls = op_times(trace_dir)
    targets: dict[str, str] = {}
    for exe in runner.target.step.executables():
        targets.update(custom_call_targets(exe.as_text()))
    kinds: collections.Counter = collections.Counter()
    for name, ns in per_op.items():
        kinds[op_kind(name, targets)] += ns
    total, n = sum(per_op.values()), args.steps
    print(f"decode step, batch {args.batch}, context {args.context}: ops sum to {total / n / 1e6:.2f} ms of thread "
          f"time per step ({wall * 1e3:.2f} ms of wall time per step under the trace)")  # fmt: skip
    print(f"\n{'op kind':<32} {'ms / step':>10} {'share':>7}")
    rows_out = []
    for kind, ns in kinds.most_common():
        rows_out.append({"name": "op kind", "config": {"kind": kind}, "ms": ns / n / 1e6, "share": ns / total})
        if ns / total >= 0.002:
            print(f"{kind:<32} {ns / n / 1e6:>10.3f} {ns / total:>7.1%}")
    print(f"\n{'op':<24} {'kind':<28} {'us / step':>10} {'calls / step':>13}")
    for name, ns in per_op.most_common(args.top):
        kind = op_kind(name, targets)
        rows_out.append(
            {"name": "op", "config": {"op": name, "kind": kind}, "ms": ns / n / 1e6, "calls": calls[name] / n}
        )
        print(f"{name[:24]:<24} {kind[:28]:<28} {ns / n / 1e3:>10.1f} {calls[name] / n:>13.1f}")
    workload = {"model": args.model, "batch": args.batch, "context": args.context, "steps": n,
                "wall_ms_per_step_traced": wall * 1e3}  # fmt: skip
    return result.document("profile", argv, workload=workload, measurements=rows_out)
