"""`jaxserve bench latency --host`: the engine thread's CPU time per decode step, by phase.

On an accelerator the chip waits for every microsecond of host work between two steps it
cannot overlap, so this measures that work, not the step's wall time: `rows` requests decode
in steady state (every prompt admitted and prefilled), the engine's thread is timed with
`time.thread_time` (waiting for the device costs nothing) and each phase (runner/host_times.py:
schedule, build, dispatch, resolve, detokenize) is summed, then divided by the decode steps
made (tokens per row). Beside it: the wall time per decode step of the same run, and the
device's time for one decode step of the same rows, timed alone (the fastest of a few calls;
it includes one dispatch).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from jaxserve.engine.tokenizer import word_tokenizer
from jaxserve.runner.host_times import PHASES, HostTimes


def random_model(layers: int, hidden: int, vocab: int, out: Path) -> Path:
    """A random Llama of that depth, width and vocabulary (4 query heads, 2 KV heads, MLP 2x
    hidden): the thin, deep shape where the host's per-layer and per-row costs show."""
    from jaxserve.tools.bench.workload import model_from_spec

    spec = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model_from_spec(spec, out)
    word_tokenizer(vocab).save_pretrained(str(out))
    return out


def _generated(llm) -> int:
    return sum(s.num_generated for s in llm.scheduler.running)


def _steady(llm) -> None:
    """Step until every request is admitted and decoding, then two more steps."""
    llm.step()
    sched = llm.scheduler
    while sched.waiting or any(s.prefilling for s in sched.running):
        llm.step()
    for _ in range(2):
        llm.step()


def measure(llm, rows: int, context: int, steps: int, seed: int) -> dict:
    """One round: `rows` greedy requests of `context` prompt tokens decoding, at least `steps`
    decode steps timed. Returns milliseconds per decode step: host (the engine thread's CPU),
    each phase, wall; and the decode steps timed."""
    from jaxserve.engine.request import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.model_cfg.vocab_size
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=0.0)
    ids = [llm.add_request(rng.integers(3, vocab, context).tolist(), params) for _ in range(rows)]
    _steady(llm)
    if len(llm.scheduler.running) != rows:
        raise ValueError(f"rows: only {len(llm.scheduler.running)} of {rows} requests run at once (max_slots?)")
    times = HostTimes()
    llm.core.time_host(times)
    made0, c0, w0 = _generated(llm), time.thread_time(), time.perf_counter()
    while (_generated(llm) - made0) < steps * rows:
        llm.step()
    c1, w1 = time.thread_time(), time.perf_counter()
    llm.core.time_host(None)
    n = (_generated(llm) - made0) / rows
    for rid in ids:
        llm.abort(rid)
    while llm.has_unfinished():
        llm.step()
    per = lambda s: 1e3 * s / n  # noqa: E731
    return {
        "decode_steps": n,
        "host_ms": per(c1 - c0),
        "wall_ms": per(w1 - w0),
        "phases_ms": {k: per(v) for k, v in times.seconds.items()},
    }


def device_ms(llm, rows: int, context: int, reps: int = 5) -> float:
    """One decode step of `rows` rows at `context` keys on the dummy page, alone: the fastest of
    `reps` blocking calls."""
    from jaxserve.runner.step_batch import DUMMY_PAGE, GREEDY, Chunk

    runner = llm.runner
    pages = [DUMMY_PAGE] * runner.max_pages_per_seq
    batch = [Chunk([0], context, pages, GREEDY)] * rows
    runner.step(batch)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.step(batch)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def line(label: str, k: int, r: dict) -> str:
    ph = ", ".join(f"{p} {r['phases_ms'][p]:.3f}" for p in PHASES)
    return (
        f"[{label}] round {k}: host {r['host_ms']:.3f} ms/step ({ph}), wall {r['wall_ms']:.2f} ms/step, "
        f"device {r['device_ms']:.2f} ms/step, {r['decode_steps']:.0f} steps"
    )
