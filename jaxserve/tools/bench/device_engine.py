"""The engine section of `jaxserve bench device`: the whole engine on a Llama-3.1-8B-shaped model.

The model is a config.json of 8B's shape (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab
128256) whose bfloat16 weights the loader makes on the device from a seeded jax.random
(loader.RANDOM_INIT): 16 GB that are never written, read or cast on the host. Random weights run
every kernel a real checkpoint runs; only the tokens they pick differ.

What it measures (no warm-up at load: each shape is compiled by an untimed run of it first):
- TTFT at each prompt length: `generate` of one prompt for one token, wall clock (what a user waits).
  Bound: the prefill's FLOPs (2 x the non-embedding weights per token, and causal attention) / GEMM peak.
- TPOT at batch 1: (time of 1 + n tokens - time of 1 token) / n. Bound: the weights and the row's
  live KV, read once a step / copy rate.
- throughput at `slots` requests at once: output tokens / wall.
- the step's shares: `trace_steps` decode steps of `slots` rows in steady state under the
  profiler (its perfetto trace kept in the output folder): wall per step, the engine thread's CPU
  per step by phase (runner/host_times.py), and the device's busy time per step from the trace.
  Roofline: (weights + the rows' live KV) / copy rate, the decode step's floor.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.tools.bench.device_timing import Record, error_text, traced

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def rehearsal_config() -> dict:
    """8B's config at a tiny size (same family, GQA and untied head)."""
    small = dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096)  # fmt: skip
    return {**LLAMA_8B, **small}


def layer_params(c: dict) -> int:
    """The parameters every token multiplies (not the embedding, not the LM head)."""
    h, d = c["hidden_size"], c["head_dim"]
    attn = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    return c["num_hidden_layers"] * (attn + 3 * h * c["intermediate_size"] + 2 * h)


def prefill_flops(c: dict, s: int) -> int:
    """A fresh prompt's FLOPs: 2 x the layers' weights per token, the LM head for the one token
    sampled, and causal attention (4 x heads x head_dim per visible (query, key) pair)."""
    attn = 4 * c["num_attention_heads"] * c["head_dim"] * s * (s + 1) // 2 * c["num_hidden_layers"]
    return 2 * layer_params(c) * s + 2 * c["hidden_size"] * c["vocab_size"] + attn


def _prompts(rng, n: int, length: int, vocab: int) -> list[list[int]]:
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def _timed_generate(llm, prompts, tokens: int) -> float:
    """Seconds for `generate` of `prompts`, each to exactly `tokens` new tokens (greedy)."""
    from jaxserve.engine.request import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    made = [len(o.token_ids) for o in outs]
    if made != [tokens] * len(prompts):
        raise ValueError(f"asked for {tokens} tokens a request, got {made[:4]}...")
    return wall


def run_engine(plan: dict, rec: Record, out_dir: str) -> None:
    """Every engine figure of the module's doc, each row written as it is measured."""
    from jaxserve.llm import LLM
    from jaxserve.models.loader import write_random_init
    from jaxserve.runner import runner_config

    c, rng = plan["config"], np.random.default_rng(plan.get("seed", 0))
    with tempfile.TemporaryDirectory(prefix="jaxserve-device-model-") as tmp:
        t0 = time.perf_counter()
        try:
            llm = LLM(write_random_init(Path(tmp), c, seed=plan.get("seed", 0)), warmup=False, **plan["engine_opts"])
        except Exception as e:  # out of memory, an option this platform refuses: said in the JSON
            rec.add({"name": "engine load", "impl": "jaxserve", "config": plan["engine_opts"], "error": error_text(e)})
            raise
        load_s = time.perf_counter() - t0
    rc = llm.runner.cfg
    weight_bytes = sum(int(x.nbytes) for x in llm.runner.target.params)
    kv_token = runner_config.kv_bytes_per_token(rc.dtype, llm.model_cfg, kv_cache_dtype=rc.kv_cache_dtype)
    rec.extra["engine"] = {"load_s": load_s, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token,
                           "model": c, "options": plan["engine_opts"], "dtype": rc.dtype,
                           "attention_impl": rc.attention_impl}  # fmt: skip
    rec.flush()
    print(f"engine: {weight_bytes / 1e9:.2f} GB of {rc.dtype} weights made in {load_s:.1f} s", flush=True)
    vocab, reps = c["vocab_size"], plan.get("reps", 2)
    for s in plan["ttft_prompts"]:
        base = {"name": "engine TTFT", "impl": "jaxserve", "config": {"prompt": s}, "flops": prefill_flops(c, s)}
        _guarded(rec, base, lambda s=s: _ttft(llm, rng, s, vocab, reps))
    p, n = plan["tpot_prompt"], plan["tpot_tokens"]
    base = {"name": "engine TPOT", "impl": "jaxserve", "config": {"rows": 1, "prompt": p, "tokens": n},
            "bytes": weight_bytes + kv_token * (p + n // 2)}  # fmt: skip
    _guarded(rec, base, lambda: _tpot(llm, rng, p, n, vocab, reps))
    slots, plen, olen = plan["slots"], plan["throughput_prompt"], plan["throughput_tokens"]
    base = {
        "name": "engine throughput",
        "impl": "jaxserve",
        "config": {"requests": slots, "prompt": plen, "tokens": olen},
    }
    _guarded(rec, base, lambda: _throughput(llm, rng, slots, plen, olen, vocab))
    base = {"name": "engine decode step", "impl": "jaxserve", "config": {"rows": slots, "steps": plan["trace_steps"]}}
    keep = str(Path(out_dir) / "engine-trace.perfetto.json.gz")
    sizes = (weight_bytes, kv_token)
    _guarded(rec, base, lambda: _step_shares(llm, rng, slots, plen, plan["trace_steps"], vocab, keep, sizes))


def _guarded(rec: Record, base: dict, measure) -> None:
    """One engine figure: measure() -> its fields, or {"error"} (an exception, or the budget spent)."""
    if rec.left_s() <= 0:
        rec.add({**base, "error": "skipped: the section's time budget was spent"})
        return
    try:
        row = rec.add({**base, **measure()})
    except Exception as e:
        rec.add({**base, "error": error_text(e)})
        return
    print(f"{row['name']} {row['config']}: {row['ms']:.3f} ms ({row['timing']})", flush=True)


def _ttft(llm, rng, s: int, vocab: int, reps: int) -> dict:
    _timed_generate(llm, _prompts(rng, 1, s, vocab), 1)  # compiles this length's prefill steps
    times = [1e3 * _timed_generate(llm, _prompts(rng, 1, s, vocab), 1) for _ in range(reps)]
    return {"ms": statistics.median(times), "timing": "wall-clock", "times_ms": times}


def _tpot(llm, rng, p: int, n: int, vocab: int, reps: int) -> dict:
    _timed_generate(llm, _prompts(rng, 1, p, vocab), n + 1)  # compiled
    one = [_timed_generate(llm, _prompts(rng, 1, p, vocab), 1) for _ in range(reps)]
    more = [_timed_generate(llm, _prompts(rng, 1, p, vocab), n + 1) for _ in range(reps)]
    ms = 1e3 * (statistics.median(more) - statistics.median(one)) / n
    if ms <= 0:
        raise ValueError(f"{n} more tokens took no longer than one: the timer's noise exceeds the decode")
    return {"ms": ms, "timing": "wall-clock"}


def _throughput(llm, rng, slots: int, plen: int, olen: int, vocab: int) -> dict:
    _timed_generate(llm, _prompts(rng, slots, plen, vocab), 4)  # compiles the batch's steps
    wall = _timed_generate(llm, _prompts(rng, slots, plen, vocab), olen)
    return {"ms": 1e3 * wall, "timing": "wall-clock", "output_tok_s": slots * olen / wall}


def _step_shares(llm, rng, slots: int, plen: int, steps: int, vocab: int, keep: str, sizes: tuple[int, int]) -> dict:
    """`steps` decode steps of `slots` rows under the profiler: wall, host CPU by phase, device busy;
    the bytes a step reads: the weights and the rows' live KV (their mean length over the steps)."""
    from jaxserve.engine.request import SamplingParams
    from jaxserve.runner.host_times import HostTimes
    from jaxserve.tools.bench.host import _steady

    # long enough that the first admitted is still decoding when the last one's prefill ends
    params = SamplingParams(max_tokens=llm.max_model_len - plen - 1, ignore_eos=True, temperature=0.0)
    ids = [llm.add_request(p, params) for p in _prompts(rng, slots, plen, vocab)]
    _steady(llm)
    if len(llm.scheduler.running) != slots:
        raise ValueError(f"only {len(llm.scheduler.running)} of {slots} requests decode at once")
    times = HostTimes()
    llm.core.time_host(times)
    cpu = []
    live = [sum(seq.length for seq in llm.scheduler.running)]

    def run():
        c0 = time.thread_time()
        for _ in range(steps):
            llm.step()
        cpu.append(time.thread_time() - c0)

    with traced(keep=keep) as t:
        t.call("engine steps", run)
    llm.core.time_host(None)
    live.append(sum(seq.length for seq in llm.scheduler.running))
    for rid in ids:
        llm.abort(rid)
    while llm.has_unfinished():
        llm.step()
    wall = t.wall_ms["engine steps"][0] / steps
    device, clock = t.times("engine steps")
    weight_bytes, kv_token = sizes
    row = {"ms": wall, "timing": "wall-clock", "host_cpu_ms": 1e3 * cpu[0] / steps, "live_tokens": sum(live) / 2,
           "bytes": weight_bytes + int(kv_token * sum(live) / 2),
           "phases_ms": {k: 1e3 * v / steps for k, v in times.seconds.items()},
           "device_busy_ms": device[0] / steps if clock == "device-trace" else None,
           "device_timing": clock, "trace_error": t.trace_error,
           "trace_file": Path(keep).name if Path(keep).is_file() else None}  # fmt: skip
    row["host_share"] = row["host_cpu_ms"] / wall
    row["device_share"] = row["device_busy_ms"] / wall if row["device_busy_ms"] is not None else None
    return row
