"""The offline driver: an `LLM` stepped from this thread, each request timed as it streams.

Requests go in through `LLM.add_request` (all at once, or `max_concurrency` at a time: 1 is
the latency bench), the loop calls `LLM.step()` and stamps every output that carries tokens on
its request's RequestTimer. Greedy, EOS ignored: each request makes exactly its output_len
tokens. Every round starts with the prefix cache flushed.
"""

from __future__ import annotations

import time
from collections import deque

from jaxserve.tools.bench.stats import RequestTimer, RoundStats
from jaxserve.tools.bench.workload import Request


def engine_options(opts: dict) -> dict:
    """JSON lists as tuples (token_buckets and the like are tuples in the engine's config)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()}


def check_fits(requests: list[Request], max_model_len: int) -> None:
    for i, r in enumerate(requests):
        if r.prompt_len + r.output_len > max_model_len:
            raise ValueError(
                f"workload: request {i} needs {r.prompt_len} + {r.output_len} tokens, more than max_model_len "
                f"{max_model_len} (shorten --prompt-len/--output-len or raise max_model_len in --engine-opts)"
            )


def run_offline(
    llm, requests: list[Request], *, max_concurrency: int | None = None, params=None, arrivals=None
) -> RoundStats:
    """One round on an LLM. RoundStats.extra gets the engine's counters that moved (prefix cache
    hits, speculative acceptance, preemptions, grammar masks) and `outputs` (the token ids, for
    equality checks). `params`: each request's own SamplingParams (bench structured's
    constraints) instead of greedy-or-sampled to exactly its output_len. `arrivals`: each request's
    arrival, seconds after the start (`bench throughput --rate`): it is added at the first step
    boundary after it and timed from its arrival, as a streaming client of the engine sees it."""
    from jaxserve.llm import SamplingParams

    llm.flush_prefix_cache()
    if llm.spec_stats is not None:
        llm.spec_stats.reset()
    before = llm.stats()
    queue = deque(enumerate(requests))
    timers: dict[str, tuple[int, RequestTimer]] = {}
    records: list = [None] * len(requests)
    outputs: list[list[int]] = [[] for _ in requests]
    limit = max_concurrency or len(requests)

    def submit() -> None:
        while queue and len(timers) < limit:
            i, r = queue[0]
            if arrivals is not None and start + arrivals[i] > time.perf_counter():
                return
            queue.popleft()
            timer = RequestTimer()
            timer.sent(None if arrivals is None else start + arrivals[i])
            sp = params[i] if params is not None else None
            if sp is None:
                sp = SamplingParams(
                    max_tokens=r.output_len,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    ignore_eos=not r.until_eos,
                    seed=i,
                )
            rid = llm.add_request(r.prompt, sp)
            timers[rid] = (i, timer)

    start = time.perf_counter()
    submit()
    while timers or queue:
        if not timers:  # idle until the next arrival
            time.sleep(max(0.0, start + arrivals[queue[0][0]] - time.perf_counter()))
            submit()
        for out in llm.step():
            now = time.perf_counter()
            if out.request_id not in timers:
                continue
            i, timer = timers[out.request_id]
            timer.chunk(len(out.token_ids), now)
            outputs[i] += out.token_ids
            if out.finished:
                records[i] = timer.done(len(out.prompt_token_ids), t=now)
                del timers[out.request_id]
        submit()
    wall = time.perf_counter() - start
    after = llm.stats()
    extra = {
        "preemptions": after["preemptions"] - before["preemptions"],
        "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        "compiles_since_warmup": llm.compiles_since_warmup(),
    }
    if after.get("grammar_mask_steps", 0) > before.get("grammar_mask_steps", 0):
        steps = after["grammar_mask_steps"] - before["grammar_mask_steps"]
        extra["grammar_mask_ms_per_step"] = (
            1e3 * (after["grammar_mask_seconds"] - before["grammar_mask_seconds"]) / steps
        )
    if "spec_mean_accepted" in after:
        extra["spec_tokens_per_target_step"] = after["spec_mean_accepted"]
        extra["spec_acceptance_by_position"] = after.get("spec_acceptance_by_position")
        for key in ("spec_target_steps", "spec_plain_steps"):  # verify slot-steps; steps run plain
            extra[key] = after.get(key, 0) - before.get(key, 0)
        if "spec_step_seconds" in after:  # adaptive prompt lookup's cost table at the round's end
            extra["spec_step_seconds"] = {
                k: {str(n): v for n, v in t.items()} for k, t in after["spec_step_seconds"].items()
            }
    return RoundStats(wall, records, extra, outputs)
