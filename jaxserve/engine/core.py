"""The engine core: one scheduler, one KV manager, one model runner and the detokenizers,
stepped by one thread.

Every frontend reaches it the same way: `make_sequence` validates and tokenizes (one
validation path, raising ValueError naming the field), `add` and `abort` go through a
thread-safe inbox drained at the start of each step, and `step` returns each touched
request's `RequestOutput` delta (one output conversion). The offline `LLM` calls `step` in
the caller's thread; `EngineClient` runs it in a background thread for the servers.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.engine.contract import ModelInfo
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.intake import Intake
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence
from jaxserve.engine.rows import plan_rows, sampled_ids, score
from jaxserve.engine.scheduler import Scheduler, StepPlan
from jaxserve.engine.speculation import Speculation
from jaxserve.engine.tokenizer import FastDecode
from jaxserve.runner.host_times import HostTimes, phase

if TYPE_CHECKING:
    from jaxserve.engine.spec_policy import SpecPolicy
    from jaxserve.engine.structured import Grammars
    from jaxserve.models.model_config import ModelConfig
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.runner.speculative import SpecStats


@dataclasses.dataclass
class _PendingStep:
    """A step on the device: its result handle, the sequences that sample (rows 0.. of the
    step, in order) and the prompt chunks it scores (row, chunk)."""

    handle: object  # model_runner.PendingStep
    seqs: list[Sequence]
    scored: list = dataclasses.field(default_factory=list)
    needs_host_tokens: bool = False  # a row's next step needs this one's token on the host (read at once)


class EngineCore(Intake):
    """Steps one scheduler, KV manager and model runner and detokenizes, on one thread.

    It is handed built parts: `engine.loading.load_engine` loads the weights, the tokenizer and a
    draft, sizes the KV pool, builds the parts and warms up, then makes one."""

    def __init__(
        self,
        *,
        cfg: EngineConfig,
        model_path: Path,
        model_cfg: ModelConfig,
        tokenizer,
        runner: ModelRunner,
        kv: KVManager,
        scheduler: Scheduler,
        grammars: Grammars,
        speculation: Speculation | None = None,
    ):
        from jaxserve.runner.executable_cache import compile_count

        self.cfg, self.model_path, self.model_cfg, self.tokenizer = cfg, model_path, model_cfg, tokenizer
        self.runner, self.kv, self.scheduler, self.grammars = runner, kv, scheduler, grammars
        self.max_model_len = runner.max_model_len
        self.speculation = speculation
        self._compile_count = compile_count
        self.mask_seconds, self.mask_steps = 0.0, 0  # host time computing grammar bitmasks, and steps that did
        self._init_intake(cfg.seed)  # the inbox and the live request ids (engine/intake.py)
        self._decoder = FastDecode(tokenizer) if tokenizer is not None else None
        # Async scheduling (vLLM's async scheduling, SGLang's overlap scheduler): the decode
        # step in flight. A speculative step needs every token on the host, so the step in
        # flight is read before one; a speculative engine's plain steps (a batch above
        # speculative_disable_by_batch_size) overlap like any other.
        self.overlap = cfg.async_scheduling
        self._pending: _PendingStep | None = None
        self.overlapped_steps = 0  # decode steps dispatched while the previous one was in flight
        self.host_times: HostTimes | None = None  # time_host
        self.multi_step_calls = 0  # calls that ran several decode steps (num_scheduler_steps)
        self.multi_step_steps = 0  # the decode steps those calls ran
        self._compiles_at_warmup = compile_count()  # the parts come warmed up (or a follower's, done)

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's proposed and accepted drafts by position (None: no speculation)."""
        return self.speculation.stats if self.speculation is not None else None

    @property
    def policy(self) -> SpecPolicy | None:
        """Adaptive prompt lookup's policy (engine/spec_policy.py), when on."""
        return self.speculation.policy if self.speculation is not None else None

    def compiles_since_warmup(self) -> int:
        return self._compile_count() - self._compiles_at_warmup

    @property
    def is_follower(self) -> bool:
        return self.runner.is_follower

    def shutdown(self) -> None:
        """With several processes, release the followers (they return from `loading.load_engine`)."""
        self.runner.release_followers()

    # -- requests (and engine/intake.py) ----------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    def grammar(self, params: SamplingParams):
        """The request's constraint compiled (or found in the cache); ValueError naming it."""
        return self.grammars.state(params)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty() or self._pending is not None

    def stats(self) -> dict:
        return {
            **self._pool_stats(),
            "grammar_mask_seconds": self.mask_seconds,
            "grammar_mask_steps": self.mask_steps,
            "overlapped_steps": self.overlapped_steps,
            "multi_step_calls": self.multi_step_calls,
            "multi_step_steps": self.multi_step_steps,
            **(self.speculation.as_dict() if self.speculation is not None else {}),
        }

    def model_info(self) -> ModelInfo:
        rc = self.runner.cfg
        kv = rc.dtype if rc.kv_cache_dtype == "auto" else rc.kv_cache_dtype
        features = [
            f"attention:{self.runner.attention_impl}",
            f"matmul:{rc.matmul_impl}:{rc.weight_dtype}",
            f"kv_cache:{kv}",
        ]
        if self.kv.prefix_cache is not None:
            features.append("prefix_caching")
        if self.speculation is not None:
            features.append(f"speculative:{self.speculation.name}")
        return ModelInfo(
            self.model_path.stem if self.model_path.suffix == ".gguf" else self.model_path.name,
            self.max_model_len,
            self.model_cfg.vocab_size,
            tuple(features),
            self.cfg.max_slots,
            self.cfg.page_size,
            self.kv.capacity,
            self.tokenizer is not None,
        )

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step: plan, dispatch, resolve. Returns each touched request's output
        since its last one.

        A speculative step (engine/speculation.py) runs and is read at once; a plain one
        (`_run_plain`: one ragged step, or several decode steps in one call) is dispatched, and
        the step before it, still in flight, is read while the device runs it."""
        t0, compiles = (time.perf_counter(), self._compile_count()) if self.policy is not None else (0.0, 0)
        finished_now = self._drain_inbox()
        touched: list[Sequence] = []
        spec = self.speculation
        read_early = False
        if self._pending is not None and spec is not None and spec.may_speculate(self.scheduler.running):
            # a speculative step proposes from every token: read the step in flight first, so
            # the plan below sees them (lengths, pages for the lookahead, who finished)
            touched += self._resolve(self._pending)
            self._pending = None
            read_early = True
            t0 = time.perf_counter()  # the verify step's own time: the plain step read here was timed as one
        plan, num_steps = self._schedule()
        verify = spec.choose(plan, self._pending is not None) if spec is not None else None
        if read_early and verify is None:  # the overlap given up for a step that then ran plain
            spec.plain_after_read += 1
        if verify is not None:
            touched += self.scheduler.update(plan, spec.run(plan, verify))
        else:  # logprobs, grammars, penalties, biases and min_p/min_tokens run in the ragged step
            touched += self._run_plain(plan, num_steps)
        # a sequence can get tokens from two steps in one call (the previous step's, then this
        # one's read at once): one output each
        once = list({id(s): s for s in touched + finished_now}.values())
        if self.policy is not None:  # a step that compiled (an engine without warm-up) is not timed
            seconds = time.perf_counter() - t0 if self._compile_count() == compiles else None
            spec.measure(plan, verify, once, seconds, overlapped=self._pending is not None)
        with phase(self.host_times, "detokenize"):
            return [self._output(seq) for seq in once]

    def time_host(self, times: HostTimes | None) -> None:
        """Time the engine thread's work by phase into `times` from now on (None: stop)."""
        self.host_times = self.runner.host_times = times

    def _schedule(self) -> tuple[StepPlan, int]:
        """This step's plan and the decode steps it may run (the scheduler gives the decodes
        pages for them); the page copies it asks for run first."""
        with phase(self.host_times, "schedule"):
            num_steps = self._steps_per_call()
            plan = self.scheduler.schedule(num_steps)
        if plan.copies:
            self.runner.copy_pages(plan.copies)
        return plan, num_steps

    def _run_plain(self, plan: StepPlan, num_steps: int) -> list[Sequence]:
        """Async scheduling: dispatch this plan as one ragged step (or several decode steps in one
        call), then read the previous step's tokens while the device runs it. A step whose rows
        need their tokens on the host before the next (grammar, penalties) is read at once, as is
        every step without overlap. Returns the sequences whose tokens were read."""
        num_steps = self._steps_this_call(plan, num_steps)
        if num_steps > 1:
            self.multi_step_calls += 1
            self.multi_step_steps += num_steps
        pending = self._dispatch(plan, num_steps) if not plan.empty else None
        self.scheduler.dispatched(plan, decodes_pending=True, num_steps=num_steps)
        touched: list[Sequence] = []
        if self._pending is not None:
            self.overlapped_steps += pending is not None
            touched += self._resolve(self._pending)
        self._pending = pending
        if pending is not None and (not self.overlap or pending.scored or pending.needs_host_tokens):
            touched += self._resolve(pending)
            self._pending = None
        return touched

    def _steps_per_call(self) -> int:
        """Decode steps the next call may run (num_scheduler_steps), decided before scheduling
        (the decodes get pages for them): several only when every running sequence plainly
        decodes (nothing the host must see between its tokens) and no prompt waits for a slot."""
        k = self.runner.max_steps
        sched = self.scheduler
        if k == 1 or not sched.running or (sched.waiting and sched.free_slots):
            return 1
        for s in sched.running:
            if s.prefilling or s.needs_host_tokens or s.params.logprobs is not None:
                return 1
        return k

    def _steps_this_call(self, plan: StepPlan, num_steps: int) -> int:
        """The planned call's decode steps: one where it carries prompt chunks; with prompts
        waiting (slots full), no more than the first running sequence needs to finish by length,
        so its slot frees as soon as it can."""
        if num_steps == 1 or plan.prefills or not plan.decodes:
            return 1
        if self.scheduler.waiting:
            num_steps = min(num_steps, min(self.scheduler.tokens_left(s) for s in plan.decodes))
        return max(1, num_steps)

    def _dispatch(self, plan: StepPlan, num_steps: int = 1) -> _PendingStep:
        """Hand one ragged step to the device without waiting for it (rows: rows.plan_rows). A
        sequence whose last token is still on the device (sampled by the previous step) is fed
        it there."""
        with phase(self.host_times, "build"):
            in_flight = self._pending.seqs if self._pending is not None else ()
            rows, feed, targets, scored = plan_rows(plan, self.scheduler.eos, self._grammar_masks(plan), in_flight)
        # one look at every row's parameters: logprobs asked, tokens the host must see (grammar, penalties)
        want_lp = host_tokens = False
        for s in plan.decodes:
            if s.params.controlled or s.params.logprobs is not None:
                want_lp = want_lp or s.params.logprobs is not None
                host_tokens = host_tokens or s.needs_host_tokens
        handle = self.runner.step_async(rows, want_lp, feed, targets, num_steps)
        return _PendingStep(handle, list(plan.decodes), scored, host_tokens)

    def _grammar_masks(self, plan: StepPlan) -> dict[int, np.ndarray]:
        """Every constrained decode's allowed tokens for this step, by its index in
        plan.decodes, filled in one call (timed: stats' grammar_mask_seconds)."""
        seqs = plan.decodes
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return {}
        t0 = time.perf_counter()
        masks = np.empty((len(constrained), self.grammars.words), np.int32)
        self.grammars.fill([seqs[i].grammar for i in constrained], masks)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_steps += 1
        return dict(zip(constrained, masks))

    def _resolve(self, step: _PendingStep) -> list[Sequence]:
        """Wait for a dispatched step's tokens (and scores) and apply them."""
        with phase(self.host_times, "resolve"):
            r = step.handle.result()
            for i, c in step.scored:
                score(c, r.prompt[i])
            return self.scheduler.apply_ids(step.seqs, *sampled_ids(step.seqs, r))
