"""`jaxserve bench device`: the one prepared accelerator run (issue 61), at most 8 minutes.

Device time is scarce (a lease of 15 minutes, now and then), so everything a lease should measure
is one command, rehearsed on the CPU at a tiny shape (`--rehearse`) so that a lease is spent
measuring, not debugging. Four sections, each in a process of its own with its own time budget
(a section that overruns is killed; one that crashes, or lacks a backend, leaves an error entry
and the run goes on), the JSON rewritten after every section (and each section's own file after
every figure) so that a run killed at any point leaves what finished:

- probes (device_kernels.py): the chip's copy rate and matmul peak, measured.
- kernels (device_kernels.py): attention prefill at S = 2k and 8k (XLA, cuDNN, Mosaic GPU,
  tokamax, jaxserve's ragged kernel) and ragged steps (decode 64 x 4,096, 1 x 8,192, mixed
  16 x 4,096 + 256), timed on the device's clock (device_timing.py).
- engine (device_engine.py): the engine on a Llama-3.1-8B-shaped random bfloat16 model made on
  the device: TTFT at 2k and 8k, TPOT at batch 1, throughput at 64 slots, a decode step's host
  and device shares, and a profiler trace of ~20 steps kept beside the JSON.
- torch (device_torch.py): PyTorch's SDPA (flash, cuDNN) and transformers' `generate` on the
  same shape: the reference, in the same window.

Every figure stands beside its bound from the probes (`bound`): a decode's bytes / copy rate, a
prefill's FLOPs / GEMM peak, the engine's decode step's (weights + live KV) / copy rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxserve.tools.bench import flags, result

SECTIONS = ("probes", "kernels", "engine", "torch")
BUDGET_S = {"full": 450.0, "rehearse": 115.0}  # each whole run's, shared among its sections as SHARES says
SHARES = {  # what each section took in rehearsals (the CPU) and is expected to take on an H100
    "full": {"probes": 0.08, "kernels": 0.27, "engine": 0.43, "torch": 0.22},
    "rehearse": {"probes": 0.06, "kernels": 0.31, "engine": 0.37, "torch": 0.26},
}
SOFT = 0.85  # a section starts no new figure after this share of its budget; it is killed at all of it
# On an accelerator the sections share jax's persistent compilation cache: a second run on the same
# machine (a rerun inside one lease) skips the 8B model's compiles.
XLA_CACHE = "/tmp/jaxserve-device-xla-cache"
JSON_NAME = "device.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxserve bench device`'s flags."""
    p.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: every section at a tiny shape")
    p.add_argument("--out", dest="out_dir", default="device-out", metavar="DIR",
                   help=f"the folder for {JSON_NAME} and the engine's trace (default device-out; the device tool's $OUT)")  # fmt: skip
    p.add_argument("--only", default=",".join(SECTIONS), metavar="SECTION,...",
                   help=f"sections to run, in this order: {','.join(SECTIONS)} (default all)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=None, metavar="N",
                   help=f"the whole run's seconds, shared among the sections run (default {BUDGET_S['full']:.0f}; "
                   f"{BUDGET_S['rehearse']:.0f} with --rehearse)")  # fmt: skip
    p.add_argument("--engine-opts", type=flags.json_object, default={}, metavar="JSON",
                   help="engine options over the section's own (e.g. '{\"max_num_batched_tokens\": 2048}')")  # fmt: skip
    p.set_defaults(out=None)  # `jaxserve bench`'s --out FILE: this command writes into its folder itself


def make_plan(rehearse: bool, engine_opts: dict | None = None) -> dict:
    """Each section's shapes: an 8B Llama's on an accelerator, a tiny model's in the rehearsal."""
    from jaxserve.tools.bench.device_engine import LLAMA_8B, rehearsal_config

    if rehearse:
        config = rehearsal_config()
        probes = {"copy_bytes": 64 << 20, "gemm_n": 512, "reps": 3}
        attn = {"heads": 4, "kv_heads": 2, "head_dim": 64, "prefill": [64, 128], "reps": 2}
        ragged = ["4x128+0", "1x256+0", "2x128+16"]
        # a small pool (a 1-row decode step on the CPU costs in proportion to the pool's size) and
        # three token buckets: every step the rehearsal runs compiles one of them
        engine = {"max_slots": 4, "max_model_len": 256, "kv_cache_memory_bytes": 4 << 20, "token_buckets": [8, 32, 128]}
        work = {"ttft_prompts": [32, 128], "tpot_prompt": 16, "tpot_tokens": 8, "slots": 4,
                "throughput_prompt": 24, "throughput_tokens": 8, "trace_steps": 20, "generate_batches": [1, 4]}  # fmt: skip
    else:
        config = dict(LLAMA_8B)
        probes = {"copy_bytes": 4 << 30, "gemm_n": 8192, "reps": 5}
        attn = {"heads": 32, "kv_heads": 8, "head_dim": 128, "prefill": [2048, 8192], "reps": 5}
        ragged = ["64x4096+0", "1x8192+0", "16x4096+256"]
        # two token buckets (64: decode of up to 64 rows; 512: prompt chunks): each bucket an 8B
        # step compiles costs tens of seconds of the lease
        engine = {"dtype": "bfloat16", "max_slots": 64, "max_model_len": 8192 + 256,
                  "kv_cache_memory_bytes": 16 << 30, "token_buckets": [64, 512]}  # fmt: skip
        work = {"ttft_prompts": [2048, 8192], "tpot_prompt": 512, "tpot_tokens": 64, "slots": 64,
                "throughput_prompt": 1024, "throughput_tokens": 128, "trace_steps": 20, "generate_batches": [1, 64]}  # fmt: skip
    engine = {**engine, "enable_prefix_caching": False, **(engine_opts or {})}  # every prompt is prefilled
    return {
        "rehearse": rehearse,
        "probes": probes,
        "kernels": {**attn, "ragged": ",".join(ragged)},
        "engine": {"config": config, "engine_opts": engine, **work, "reps": 2},
        "torch": {**probes, **attn, "config": config, **work, "tpot_tokens": max(16, work["tpot_tokens"] // 2)},
    }


def bound(row: dict, probes: dict) -> None:
    """Set a figure beside its bound (in place): bytes / the copy rate, FLOPs / the GEMM peak,
    whichever is larger, and the fraction of it reached (bound_ms / ms). Probes and figures
    without bytes or FLOPs, or a run without probes, get none."""
    copy, peak = probes.get("copy_gbps"), probes.get("gemm_tflops")
    if "ms" not in row or not row["ms"] or row["name"].startswith("probe"):
        return
    if row.get("bytes") and copy:
        row["bytes_bound_ms"] = row["bytes"] / (copy * 1e9) * 1e3
        row["fraction_of_copy_rate"] = row["bytes_bound_ms"] / row["ms"]
    if row.get("flops") and peak:
        row["flops_bound_ms"] = row["flops"] / (peak * 1e12) * 1e3
        row["fraction_of_gemm_peak"] = row["flops_bound_ms"] / row["ms"]
    options = {"copy": row.get("bytes_bound_ms", 0.0), "gemm": row.get("flops_bound_ms", 0.0)}
    kind = max(options, key=options.get)
    if options[kind]:
        row["bound"], row["bound_ms"] = kind, options[kind]
        row["fraction_of_bound"] = options[kind] / row["ms"]
        if row.get("device_busy_ms"):  # the engine's step: the device's own time against the roofline too
            row["device_fraction_of_bound"] = options[kind] / row["device_busy_ms"]


def _section(
    name: str, plan: dict, budget_s: float, out_dir: Path, tmp: Path, rehearse: bool
) -> tuple[dict, list[dict]]:
    """Run one section in a child process with a hard limit of budget_s; (its fields, its figures)."""
    plan_file, rec_file = tmp / f"{name}.plan.json", tmp / f"{name}.json"
    plan_file.write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "jaxserve.tools.bench.device", name, str(plan_file), str(rec_file),
           str(SOFT * budget_s), str(out_dir)]  # fmt: skip
    t0, fields = time.monotonic(), {"budget_s": budget_s}
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its lines reach the log as they are printed
        if not rehearse:
            env.setdefault("JAX_COMPILATION_CACHE_DIR", XLA_CACHE)
        proc = subprocess.run(cmd, timeout=budget_s, stdin=subprocess.DEVNULL, env=env)
        fields["rc"] = proc.returncode
        if proc.returncode:
            fields["error"] = f"the section's process exited with {proc.returncode} (its output is in the log)"
    except subprocess.TimeoutExpired:
        fields["rc"], fields["error"] = None, f"killed at its budget of {budget_s:.0f} s; the figures before stand"
    fields["seconds"] = time.monotonic() - t0
    got = json.loads(rec_file.read_text()) if rec_file.is_file() else {}
    rows = got.pop("measurements", [])
    return {**fields, **got}, [{"section": name, **r} for r in rows]


def summary(doc: dict) -> dict:
    """The headline: the ceilings, and the engine against transformers' floor."""
    rows = {(r["name"], r["impl"], json.dumps(r["config"], sort_keys=True)): r for r in doc["measurements"]}
    pick = lambda name, impl: [r for (n, i, _), r in rows.items() if n == name and i == impl and "ms" in r]  # noqa: E731
    out = dict(doc["sections"].get("probes", {}).get("probes") or {})
    engine_tpot, hf = pick("engine TPOT", "jaxserve"), {r["config"]["rows"]: r for r in pick("transformers TPOT", "transformers")}  # fmt: skip
    if engine_tpot and 1 in hf:
        out["tpot_batch1_vs_transformers"] = hf[1]["ms"] / engine_tpot[0]["ms"]
    step = pick("engine decode step", "jaxserve")
    if step and step[0]["config"]["rows"] in hf:
        out["decode_step_vs_transformers"] = hf[step[0]["config"]["rows"]]["ms"] / step[0]["ms"]
    return out


def run(args, argv) -> dict:
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        raise ValueError(f"only: unknown section(s) {bad} (sections: {', '.join(SECTIONS)})")
    mode = "rehearse" if args.rehearse else "full"
    total, shares = args.budget_s or BUDGET_S[mode], SHARES[mode]
    share = sum(shares[s] for s in only)
    plan = make_plan(args.rehearse, args.engine_opts)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = result.document("device", argv, workload={"rehearse": args.rehearse, "budget_s": total, "plan": plan},
                          sections={})  # fmt: skip
    probes: dict = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-device-") as tmp:
        for name in only:
            budget = total * shares[name] / share
            print(f"== {name}: budget {budget:.0f} s", flush=True)
            fields, rows = _section(name, plan[name], budget, out_dir, Path(tmp), args.rehearse)
            probes = fields.get("probes") or probes
            doc["sections"][name] = fields
            doc["measurements"] += rows
            for r in doc["measurements"]:
                bound(r, probes)
            doc["summary"] = summary(doc)
            result.write(doc, str(out_dir / JSON_NAME))
            print(f"== {name}: {fields['seconds']:.1f} s, {len(rows)} figures, {sum('error' in r for r in rows)} "
                  f"errors{'; ' + fields['error'] if fields.get('error') else ''}", flush=True)  # fmt: skip
    _print_table(doc)
    return doc


def _print_table(doc: dict) -> None:
    for r in doc["measurements"]:
        what = (
            f"{r['section']:8s} {r['name']:24s} {r['impl']:22s} {json.dumps(r['config'], separators=(',', ':'))[:60]}"
        )
        if "error" in r:
            print(f"{what}: error: {r['error'][:100]}")
        else:
            frac = f" = {r['fraction_of_bound']:.2f} of the {r['bound']} bound" if "bound" in r else ""
            print(f"{what}: {r['ms']:.4g} ms ({r.get('timing')}){frac}")


def section_main(argv: list[str]) -> int:
    """A child: `python -m jaxserve.tools.bench.device SECTION PLAN RECORD SOFT_S OUT_DIR`."""
    from jaxserve.tools.bench.device_timing import Record

    name, plan_file, rec_file, soft_s, out_dir = argv
    plan = json.loads(Path(plan_file).read_text())
    rec = Record(rec_file, time.monotonic() + float(soft_s))
    rec.flush()
    if name == "torch":
        from jaxserve.tools.bench.device_torch import run_torch

        run_torch(plan, rec)
        return 0
    import jax

    rec.extra["platform"] = {"jax": jax.__version__, "backend": jax.default_backend(),
                             "device": jax.devices()[0].device_kind}  # fmt: skip
    from jaxserve.tools.bench import device_engine, device_kernels

    run = {"probes": device_kernels.run_probes, "kernels": device_kernels.run_kernels}.get(name)
    run(plan, rec) if run else device_engine.run_engine(plan, rec, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(section_main(sys.argv[1:]))
