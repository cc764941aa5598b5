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
import itertools
import numbers
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import numpy as np

from jaxserve.engine import request as request_mod
from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.contract import ModelInfo, completion_ids
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence, Status
from jaxserve.engine.rows import plan_rows, sampled_tokens, score
from jaxserve.engine.scheduler import Scheduler, StepPlan
from jaxserve.engine.speculation import Speculation
from jaxserve.engine.tokenizer import FastDecode, IncrementalDetokenizer
from jaxserve.runner.host_times import HostTimes, phase

if TYPE_CHECKING:
    from jaxserve.engine.spec_policy import SpecPolicy
    from jaxserve.engine.structured import Grammars
    from jaxserve.models.model_config import ModelConfig
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.runner.speculative import SpecStats


def _token_ids(prompt: object) -> list[int]:
    """A prompt of token ids as a list of ints: a sequence of integers (Python or numpy ints,
    not bools) or a 1-D numpy integer array; ValueError naming `prompt_token_ids` (or `prompt`)."""
    if isinstance(prompt, Mapping) or (
        isinstance(prompt, Seq) and not isinstance(prompt, str) and any(isinstance(t, Mapping) for t in prompt)
    ):
        raise ValueError("prompt: a list of chat messages is a conversation; use LLM.chat (or send it as messages)")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(
                f"prompt_token_ids: a numpy prompt must be a 1-D integer array, got {prompt.ndim}-D {prompt.dtype}"
            )
        return [int(t) for t in prompt]
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Seq):
        raise ValueError(f"prompt: must be text or a list of token ids, got {type(prompt).__name__}")
    for i, t in enumerate(prompt):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt_token_ids[{i}]: token ids must be integers, got {type(t).__name__} {t!r:.40}")
    return [int(t) for t in prompt]


def _completions(seq: Sequence) -> list[Sequence]:
    """The n sequences of a request: index 0 is `seq`; the others share its prompt (and,
    once it has been prefilled, its KV pages: Scheduler forks them) with their own seeds."""
    out = [seq]
    for i, rid in enumerate(completion_ids(seq.request_id, seq.params.n)[1:], start=1):
        state = np.random.SeedSequence([seq.seed, i]).generate_state(2, np.uint64)
        out.append(
            Sequence(
                request_id=rid,
                prompt_ids=seq.prompt_ids,
                params=seq.params,
                seed=int(state[0] >> np.uint64(1)),
                arrival=seq.arrival,
                index=i,
                parent_id=seq.request_id,
                leader=seq,
                grammar=seq.grammar.fork() if seq.grammar is not None else None,
            )
        )
    return out


@dataclasses.dataclass
class _PendingStep:
    """A step on the device: its result handle, the sequences that sample (rows 0.. of the
    step, in order) and the prompt chunks it scores (row, chunk)."""

    handle: object  # model_runner.PendingStep
    seqs: list[Sequence]
    scored: list = dataclasses.field(default_factory=list)


class EngineCore:
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
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._decoder = FastDecode(tokenizer) if tokenizer is not None else None
        # The ids of every completion added and not yet finished (under _lock: add is called from
        # other threads): a new request may not reuse any of them.
        self._live_ids: set[str] = set()
        self._arrival = itertools.count()
        self._rng = np.random.default_rng(cfg.seed)
        self._lock = threading.Lock()
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

    # -- requests ----------------------------------------------------------------------
    def render_chat(self, messages: Conversation | Seq[dict]) -> list[int]:
        """Prompt token ids of a conversation, by the checkpoint's chat template (engine/chat.py);
        ValueError naming `messages`. Frontends call it through tokenize, in worker threads."""
        return render(self.tokenizer, Conversation.of(messages), self.model_path)

    def tokenize(self, prompt: str | Seq[int] | Conversation) -> list[int]:
        """Prompt token ids, validated; ValueError naming the field."""
        if isinstance(prompt, Conversation):
            return self.render_chat(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: {self.model_path} has no tokenizer; send token ids instead of text")
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not ids:
                raise ValueError("prompt: the text tokenizes to no tokens")
            return ids
        ids = _token_ids(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        self.check_in_vocab("prompt_token_ids", ids)
        return ids

    def check_in_vocab(self, name: str, ids: Seq[int]) -> None:
        """ValueError naming `name` when a token id lies outside the vocabulary."""
        v = self.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {v})")

    def make_sequence(
        self,
        prompt: str | Seq[int] | Conversation,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        """Validate and tokenize; raises ValueError naming the field before anything is scheduled."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        if params.prompt_logprobs is not None and not self.cfg.enable_prompt_logprobs:
            raise ValueError("prompt_logprobs: this engine was started with enable_prompt_logprobs=False")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        self._check_token_ids(params)
        grammar = self.grammars.state(params)  # compiles (or finds in the cache) the constraint: ValueError naming it
        with self._lock:  # frontends validate in worker threads
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
            arrival = next(self._arrival)
        return Sequence(
            request_id=request_id or uuid.uuid4().hex,
            prompt_ids=ids,
            params=params,
            seed=seed,
            arrival=arrival,
            grammar=grammar,
        )

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            self.check_in_vocab(name, ids)
        if params.min_tokens and len(self.scheduler.eos | set(params.stop_token_ids)) > request_mod.MAX_STOP_IDS:
            raise ValueError(
                f"min_tokens: with min_tokens set, EOS and stop_token_ids may hold at most "
                f"{request_mod.MAX_STOP_IDS} ids together"
            )

    def any_live(self, ids: Iterable[str]) -> bool:
        """Whether any of these completion ids is added and not yet finished (thread-safe)."""
        with self._lock:
            return not self._live_ids.isdisjoint(ids)

    def add(self, seq: Sequence) -> str:
        """Queue a sequence made by make_sequence (thread-safe). ValueError naming request_id
        when any of its completions' ids is live: a client's own "x#1" and completion 1 of "x"
        would share the engine's per-id state, and a KeyError would end the engine loop."""
        ids = completion_ids(seq.request_id, seq.params.n)
        with self._lock:
            taken = next((rid for rid in ids if rid in self._live_ids), None)
            if taken is not None:
                raise ValueError(f"request_id: {taken!r} is already in use")
            self._live_ids.update(ids)
        self._inbox.put(("add", seq))
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Takes effect at the start of the next step: the slot and pages are free within one step."""
        self._inbox.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty() or self._pending is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns pages freed."""
        return self.kv.flush_prefix_cache()

    def stats(self) -> dict:
        pc, alloc = self.kv.prefix_cache, self.kv.alloc
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": alloc.capacity,
            "kv_pages_free": alloc.num_free,
            "kv_pages_used": alloc.capacity - alloc.num_free,
            # pages running requests hold (shared ones once): the rest of the used ones are
            # cached prefixes no request reads, which admission evicts when it needs room
            "kv_pages_active": len({p for s in self.scheduler.running for p in s.pages}),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": pc.hit_tokens if pc else 0,
            "prefix_cache_queried_tokens": pc.queried_tokens if pc else 0,
            "prefix_cache_hit_rate": pc.hit_rate if pc else 0.0,
            "prefix_cache_pages": pc.num_cached_pages if pc else 0,
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
        if self._pending is not None and spec is not None and spec.may_speculate(self.scheduler.running):
            # a speculative step proposes from every token: read the step in flight first, so
            # the plan below sees them (lengths, pages for the lookahead, who finished)
            touched += self._resolve(self._pending)
            self._pending = None
            t0 = time.perf_counter()  # the verify step's own time: the plain step read here was timed as one
        plan, num_steps = self._schedule()
        verify = spec.choose(plan, self._pending is not None) if spec is not None else None
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

    def _drain_inbox(self) -> list[Sequence]:
        """Apply the adds and aborts queued from any thread (the loop is the only writer of
        scheduler state); returns the sequences the aborts finished."""
        finished: list[Sequence] = []
        while not self._inbox.empty():
            op, arg = self._inbox.get()
            if op == "add":  # its ids are unique among the live ones (`add` checked)
                stop_ids = self.scheduler.eos | set(arg.params.stop_token_ids)
                for seq in _completions(arg):
                    self._detok[seq.request_id] = IncrementalDetokenizer(self._decoder, stop_ids)
                    self.scheduler.add(seq)
            elif op == "abort":  # every completion of the request
                finished.extend(self.scheduler.abort(arg))
        return finished

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
        if pending is not None and (
            not self.overlap or pending.scored or any(s.needs_host_tokens for s in pending.seqs)
        ):
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
        want_lp = any(s.params.logprobs is not None for s in plan.decodes)
        handle = self.runner.step_async(rows, want_lp, feed, targets, num_steps)
        return _PendingStep(handle, list(plan.decodes), scored)

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
            return self.scheduler.apply(step.seqs, sampled_tokens(step.seqs, r))

    def _output(self, seq: Sequence) -> RequestOutput:
        d = self._detok[seq.request_id]
        if d.update(seq):
            if seq.finish_reason == "length":
                # the last allowed token completed the stop string: the text ends at the stop
                # string, so the reason is "stop" (as vLLM reports it), not "length"
                seq.finish_reason = "stop"
            self.scheduler.finish(seq, "stop")
        out = d.delta(seq)
        out.request_id, out.index = seq.parent_id, seq.index
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            src = seq.leader or seq  # the other completions of a prompt share its first one's
            out.prompt_logprobs, out.prompt_ranks = src.prompt_logprobs, src.prompt_ranks
            seq.prompt_logprobs_sent = True
        if seq.status is Status.FINISHED:
            self._detok.pop(seq.request_id, None)
            with self._lock:
                self._live_ids.discard(seq.request_id)
        return out
