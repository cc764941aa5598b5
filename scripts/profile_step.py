"""Where one decode step's time goes, op by op, as XLA ran it.

    python scripts/profile_step.py [--model ../shared/workloads/mixed-64.json] [--batch 32]
        [--context 512] [--steps 10] [--top 25]

Builds the same random-weight step `jaxserve kv-math --measure-host` times (the engine's
default attention and matmul for this backend), runs it under `jax.profiler.trace` and reads
the trace back with `jax.profiler.ProfileData`: per op (a fusion, a custom call such as the
native kernels, a conditional), its time per step summed over the threads that ran it, and the
share of the step. An op that should be cheap and is not (a fusion recomputing something per
element, sampling passes over the logits that do nothing) shows up at once here, and not in
`perf`, which sees only XLA's generated code. Custom calls are named by their target
(`jaxserve_matmul_f32`, `jaxserve_paged_attention`). Op times are as XLA's runtime records them;
the wall time per step under the trace also pays for tracing Python, so time steps with
`jaxserve kv-math --measure-host` instead. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from jaxserve.tools.kv_math_cli import _model_shape, decode_step_runner, time_decode_steps  # noqa: E402

_SKIP = ("ThunkExecutor", "ThreadpoolListener")  # containers of the ops, not ops


def op_kind(name: str, targets: dict[str, str]) -> str:
    """'ffi_call.124' -> its custom-call target ('jaxserve_matmul_f32'); 'ynn_fusion.3' ->
    'ynn_fusion': XLA numbers each instance of an op."""
    return targets.get(name) or name.split(".")[0]


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """{instruction name: custom_call_target} from a compiled module's text."""
    out = {}
    for m in re.finditer(r"%([\w.-]+) = [^\n]*? custom-call\([^\n]*?custom_call_target=\"([^\"]+)\"", hlo_text):
        out[m.group(1)] = m.group(2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="../shared/workloads/mixed-64.json", help="preset name or model JSON")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="steps traced (after 3 untraced)")
    ap.add_argument("--top", type=int, default=25, help="ops listed")
    ap.add_argument("--matmul-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.context < 1 or args.steps < 1:
        ap.error("--batch, --context and --steps must be >= 1")

    runner, rows = decode_step_runner(
        _model_shape(args.model),  # a preset, a config or a GGUF file, as kv-math takes it
        args.batch,
        args.context,
        matmul_dtype=args.matmul_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    time_decode_steps(runner, rows, 3)  # compile and warm
    trace_dir = tempfile.mkdtemp(prefix="jaxserve-profile-")
    with jax.profiler.trace(trace_dir):
        wall = time_decode_steps(runner, rows, args.steps)
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        print(f"no trace written under {trace_dir}", file=sys.stderr)
        return 1
    data = jax.profiler.ProfileData.from_file(files[0])

    per_op: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python" or not plane.name.startswith("/host:CPU"):
                continue
            for ev in line.events:
                if ev.name.startswith(_SKIP) or ev.name.startswith("end: "):
                    continue
                per_op[ev.name] += ev.duration_ns
                calls[ev.name] += 1
    targets: dict[str, str] = {}
    for exe in runner.target.step.executables():
        targets.update(custom_call_targets(exe.as_text()))
    kinds: collections.Counter = collections.Counter()
    for name, ns in per_op.items():
        kinds[op_kind(name, targets)] += ns
    total = sum(per_op.values())
    n = args.steps
    print(
        f"decode step, batch {args.batch}, context {args.context}: ops sum to {total / n / 1e6:.2f} ms of "
        f"thread time per step (median {wall * 1e3:.2f} ms of wall time per step under the trace, whose "
        "Python tracing adds several ms: time steps with kv-math --measure-host)"
    )
    print(f"\n{'op kind':<32} {'ms / step':>10} {'share':>7}")
    for kind, ns in kinds.most_common():
        if ns / total < 0.002:
            break
        print(f"{kind:<32} {ns / n / 1e6:>10.3f} {ns / total:>7.1%}")
    print(f"\n{'op':<24} {'kind':<28} {'us / step':>10} {'calls / step':>13}")
    for name, ns in per_op.most_common(args.top):
        print(f"{name[:24]:<24} {op_kind(name, targets)[:28]:<28} {ns / n / 1e3:>10.1f} {calls[name] / n:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
