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
import logging
import numbers
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Sequence as Seq

import numpy as np

from jaxserve.engine import allocator as allocator_mod
from jaxserve.engine import request as request_mod
from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import MAX_LOGPROBS, RequestOutput, SamplingParams, Sequence, Status
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.tokenizer import FastDecode, IncrementalDetokenizer, load_tokenizer
from jaxserve.models import registry
from jaxserve.runner.host_times import HostTimes, phase
from jaxserve.runner.step_batch import Chunk, Controls

log = logging.getLogger("jaxserve.engine")


def completion_ids(request_id: str, n: int) -> list[str]:
    """The request ids of a request's n completions: its own, then `id#1` .. `id#(n-1)`."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a frontend reports about the served model (gRPC GetModelInfo, HTTP /v1/models)."""

    model_name: str
    context_length: int
    vocab_size: int
    features: tuple[str, ...]
    max_slots: int
    page_size: int
    num_kv_pages: int
    has_tokenizer: bool


@dataclasses.dataclass
class _PendingStep:
    """A step on the device: its result handle, the sequences that sample (rows 0.. of the
    step, in order) and the prompt chunks it scores (row, chunk)."""

    handle: object  # model_runner.PendingStep
    seqs: list[Sequence]
    scored: list = dataclasses.field(default_factory=list)


class EngineCore:
    def __init__(
        self, model: str | Path | None = None, *, warmup: bool = True, log_progress: bool = False, **engine_options
    ):
        from jaxserve.models.loader import load_model
        from jaxserve.runner import model_runner, runner_config, step_batch
        from jaxserve.runner.executable_cache import compile_count

        assert step_batch.DUMMY_PAGE == allocator_mod.DUMMY_PAGE, "allocator and runner disagree on the dummy page"
        for name in ("PENALTY_TOKENS", "MAX_LOGIT_BIAS", "MAX_STOP_IDS"):
            assert getattr(step_batch, name) == getattr(request_mod, name), f"request and runner disagree on {name}"
        self._compile_count = compile_count
        path = Path(model) if model is not None else registry.default_model()
        self.cfg = EngineConfig(**engine_options)
        module, self.model_cfg = load_model(path, dtype=self.cfg.dtype, quantization=self.cfg.quantization)
        self.model_path = path
        self.tokenizer = load_tokenizer(path)
        draft, draft_cfg = self._load_draft(module)
        import jax
        from flax import nnx

        # by identity: an EAGLE head's embedding is the target's array
        arrays = {id(x): x for m in (module, draft) if m is not None for x in jax.tree.leaves(nnx.state(m))}
        weight_bytes = sum(x.size * x.dtype.itemsize for x in arrays.values())
        rc = runner_config.resolve(self.model_cfg, draft_cfg, self.cfg, weight_bytes, MAX_LOGPROBS)
        self.runner = model_runner.ModelRunner(module, self.model_cfg, rc, draft, draft_cfg)
        self.max_model_len = rc.max_model_len
        log.info(
            "KV cache: %d pages x %d tokens (%.1f MiB, %s), %d slots, max_model_len %d, attention %s",
            rc.num_pages,
            rc.page_size,
            rc.num_pages
            * rc.page_size
            * runner_config.kv_bytes_per_token(rc.dtype, self.model_cfg, draft_cfg, kv_cache_dtype=rc.kv_cache_dtype)
            / 2**20,
            rc.dtype if rc.kv_cache_dtype == "auto" else rc.kv_cache_dtype,
            rc.max_slots,
            rc.max_model_len,
            rc.attention_impl,
        )
        log.info("matmul: %s, %s weights (%s)", rc.matmul_impl, rc.weight_dtype, rc.matmul_reason)
        self.spec_k = self.runner.spec_k
        self.speculative_name = None
        self.spec_stats = None
        if self.spec_k:
            from jaxserve.runner.speculative import SpecStats

            self.speculative_name = (
                "ngram" if draft is None else "eagle" if self.runner.eagle else Path(self.cfg.speculative_model).name
            )
            self.spec_stats = SpecStats(self.spec_k)
        self.policy = None  # adaptive prompt lookup (engine/spec_policy.py)
        if self.speculative_name == "ngram" and self.cfg.speculative_adaptive:
            from jaxserve.engine.spec_policy import SpecPolicy

            self.policy = SpecPolicy(self.spec_k, self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max)
        # Steps with more decoding sequences than this run plain (EngineConfig's comment).
        self.spec_max_batch = rc.speculative_disable_by_batch_size
        self.spec_plain_steps = 0  # steps run plain because of it
        allocator = PageAllocator(rc.num_pages, self.cfg.page_size)
        self.kv = KVManager(allocator, RadixCache(allocator) if self.cfg.enable_prefix_caching else None)
        self.scheduler = Scheduler(
            self.kv,
            self.cfg.max_slots,
            self.max_model_len,
            max_num_batched_tokens=rc.token_buckets[-1],
            eos_token_ids=self._eos_ids(),
            lookahead=self.spec_k,
            max_prefill_tokens_while_decoding=self.cfg.max_prefill_tokens_while_decoding,
            token_buckets=rc.token_buckets,
        )
        from jaxserve.engine.structured import Grammars

        self.grammars = Grammars(self.tokenizer, self.model_cfg.vocab_size, self._eos_ids())
        self.mask_seconds, self.mask_steps = 0.0, 0  # host time computing grammar bitmasks, and steps that did
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._decoder = FastDecode(self.tokenizer) if self.tokenizer is not None else None
        # The ids of every completion added and not yet finished (under _lock: add is called from
        # other threads): a new request may not reuse any of them.
        self._live_ids: set[str] = set()
        self._arrival = itertools.count()
        self._rng = np.random.default_rng(self.cfg.seed)
        self._lock = threading.Lock()
        # Async scheduling (vLLM's async scheduling, SGLang's overlap scheduler): the decode
        # step in flight. A speculative step needs every token on the host, so the step in
        # flight is read before one; a speculative engine's plain steps (a batch above
        # speculative_disable_by_batch_size) overlap like any other.
        self.overlap = self.cfg.async_scheduling
        self._pending: _PendingStep | None = None
        self.overlapped_steps = 0  # decode steps dispatched while the previous one was in flight
        self.host_times: HostTimes | None = None  # time_host
        self.multi_step_calls = 0  # calls that ran several decode steps (num_scheduler_steps)
        self.multi_step_steps = 0  # the decode steps those calls ran
        if self.runner.is_follower:
            # Another host's process: replay the leader's runner calls (its warm-up included)
            # until it shuts down. The scheduler and the frontends run on process 0 only.
            self.runner.follow_leader()
            self._compiles_at_warmup = compile_count()
            return
        if warmup:
            say = (lambda m: print(f"[jaxserve] {m}", file=sys.stderr, flush=True)) if log_progress else None
            secs = self.runner.warmup(say)
            if self.policy is not None:  # the verify step's cost on this host, from measured steps
                from jaxserve.engine.spec_policy import StepCosts

                self.policy.costs = StepCosts(self.runner.time_steps())
            store = self.runner.store
            log.info(
                "warm-up compiled every bucket in %.1fs%s",
                secs,
                f" ({store.loaded} executables loaded from {store.dir}, {store.saved} compiled and saved)"
                if store is not None
                else "",
            )
        self._compiles_at_warmup = compile_count()

    def _load_draft(self, target):
        """(draft module, its config) for `speculative_model`, or (None, None): a draft
        checkpoint, or an EAGLE head, which shares `target`'s embedding."""
        spec = self.cfg.speculative_model
        if spec is None or spec == "ngram":
            return None, None
        from jaxserve.models import eagle
        from jaxserve.models.loader import load_model

        if spec == "default":
            raise ValueError(
                "speculative_model: no draft model ships with the default model (an EAGLE head trained on this "
                "project's 2-core machine made batch-1 decoding slower: docs/default-model.md); use 'ngram' "
                "(prompt lookup), an EAGLE head (scripts/train_eagle.py) or a draft checkpoint that shares "
                "the target's tokenizer"
            )
        if eagle.is_eagle_dir(spec):
            import jax.numpy as jnp

            dtype = jnp.dtype(self.cfg.dtype) if self.cfg.dtype else target.input_embedding().dtype
            return eagle.load_head(spec, target, self.model_cfg, dtype)
        draft, dcfg = load_model(spec, dtype=self.cfg.dtype, quantization=self.cfg.quantization)
        if dcfg.vocab_size != self.model_cfg.vocab_size:
            raise ValueError(
                f"speculative_model: the draft's vocabulary ({dcfg.vocab_size}) differs from the "
                f"target's ({self.model_cfg.vocab_size})"
            )
        return draft, dcfg

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def compiles_since_warmup(self) -> int:
        return self._compile_count() - self._compiles_at_warmup

    @property
    def is_follower(self) -> bool:
        return self.runner.is_follower

    def shutdown(self) -> None:
        """With several processes, release the followers (they return from their constructor)."""
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
        ids = self._token_ids(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        self.check_in_vocab("prompt_token_ids", ids)
        return ids

    @staticmethod
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

    def _completions(self, seq: Sequence) -> list[Sequence]:
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
            **(self.spec_stats.as_dict() if self.spec_stats else {}),
            **({"spec_plain_steps": self.spec_plain_steps} if self.spec_stats else {}),
            **({"spec_step_seconds": self.policy.costs.table} if self.policy is not None else {}),
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
        if self.speculative_name:
            features.append(f"speculative:{self.speculative_name}")
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
        """One scheduler step. Returns each touched request's output since its last one."""
        t0, compiles = (time.perf_counter(), self._compile_count()) if self.policy is not None else (0.0, 0)
        finished_now: list[Sequence] = []
        while not self._inbox.empty():
            op, arg = self._inbox.get()
            if op == "add":  # its ids are unique among the live ones (`add` checked)
                stop_ids = self.scheduler.eos | set(arg.params.stop_token_ids)
                for seq in self._completions(arg):
                    self._detok[seq.request_id] = IncrementalDetokenizer(self._decoder, stop_ids)
                    self.scheduler.add(seq)
            elif op == "abort":  # every completion of the request
                finished_now.extend(self.scheduler.abort(arg))
        touched: list[Sequence] = []
        if self._pending is not None and self._may_speculate():
            # a speculative step proposes from every token: read the step in flight first, so
            # the plan below sees them (lengths, pages for the lookahead, who finished)
            touched += self._resolve(self._pending)
            self._pending = None
            t0 = time.perf_counter()  # the verify step's own time: the plain step read here was timed as one
        with phase(self.host_times, "schedule"):
            num_steps = self._steps_per_call()
            plan = self.scheduler.schedule(num_steps)
        if plan.copies:
            self.runner.copy_pages(plan.copies)
        speculate = plan.decodes and self.spec_k and not any(s.params.plain_decode_only for s in plan.decodes)
        if speculate and (
            self._pending is not None or (self.spec_max_batch is not None and len(plan.decodes) > self.spec_max_batch)
        ):
            speculate = False
            self.spec_plain_steps += 1
        rows = self._lookup_rows(plan) if speculate else None
        if rows == "plain":  # adaptive prompt lookup: no draft pays this step
            speculate, rows = False, None
            self.spec_plain_steps += 1
        if speculate:
            if rows is not None:  # prompt lookup: one ragged step verifies the decodes beside the chunks
                touched += self.scheduler.update(plan, self._speculate_ragged(plan.decodes, rows))
            else:  # a draft model proposes on the device first; prompt logprobs; more tokens than a step
                if plan.prefills:
                    self._prefill(plan.prefills)
                touched += self.scheduler.update(plan, self._speculate(plan.decodes))
        else:  # logprobs, grammars, penalties, biases and min_p/min_tokens run in the ragged step
            # Async scheduling: dispatch this step, then read the previous one's tokens while
            # the device runs it. A step whose rows need their tokens on the host before the
            # next (grammar, penalties) is read at once, as is every step without overlap.
            num_steps = self._steps_this_call(plan, num_steps)
            if num_steps > 1:
                self.multi_step_calls += 1
                self.multi_step_steps += num_steps
            pending = self._dispatch(plan, num_steps) if not plan.empty else None
            self.scheduler.dispatched(plan, decodes_pending=True, num_steps=num_steps)
            if self._pending is not None:
                self.overlapped_steps += pending is not None
                touched += self._resolve(self._pending)
            self._pending = pending
            if pending is not None and (
                not self.overlap or pending.scored or any(s.needs_host_tokens for s in pending.seqs)
            ):
                touched += self._resolve(pending)
                self._pending = None
        # a sequence can get tokens from two steps in one call (the previous step's, then this
        # one's read at once): one output each
        once = list({id(s): s for s in touched + finished_now}.values())
        if self.policy is not None:  # a step that compiled (an engine without warm-up) is not timed
            seconds = time.perf_counter() - t0 if self._compile_count() == compiles else None
            self._measure(plan, speculate, rows, once, seconds)
        with phase(self.host_times, "detokenize"):
            return [self._output(seq) for seq in once]

    def time_host(self, times: HostTimes | None) -> None:
        """Time the engine thread's work by phase into `times` from now on (None: stop)."""
        self.host_times = self.runner.host_times = times

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

    def _steps_this_call(self, plan, num_steps: int) -> int:
        """The planned call's decode steps: one where it carries prompt chunks; with prompts
        waiting (slots full), no more than the first running sequence needs to finish by length,
        so its slot frees as soon as it can."""
        if num_steps == 1 or plan.prefills or not plan.decodes:
            return 1
        if self.scheduler.waiting:
            num_steps = min(num_steps, min(self.scheduler.tokens_left(s) for s in plan.decodes))
        return max(1, num_steps)

    def _measure(self, plan, speculated: bool, rows, seqs: list[Sequence], seconds: float | None) -> None:
        """Adaptive prompt lookup's inputs: each touched request's new tokens against its shadow
        window, and a decode-only step's time (plain by rows, speculative by real tokens)."""
        for seq in seqs:
            if seq.status is Status.FINISHED:
                self.policy.forget(seq.request_id)
            else:
                self.policy.observe(seq.request_id, seq.all_ids, len(seq.prompt_ids))
        if seconds is not None and plan.decodes and not plan.prefills and not plan.preempted:
            if speculated and rows is not None:
                self.policy.costs.observe("spec", sum(len(r.tokens) for r in rows), seconds)
            elif not speculated and self._pending is not None:  # an overlapped step: its period
                self.policy.costs.observe("plain", len(plan.decodes), seconds)

    def _propose(self, seq: Sequence) -> tuple[list[int], float]:
        """Prompt lookup's drafts for a sequence (EngineConfig's prompt_lookup_min/max) and, when
        adaptive, their acceptance estimate (1.0 otherwise)."""
        if self.policy is not None:
            self.policy.observe(seq.request_id, seq.all_ids, len(seq.prompt_ids))
            return self.policy.propose(seq.request_id, seq.all_ids)
        from jaxserve.runner.speculative import ngram_propose

        c = self.cfg
        return ngram_propose(seq.all_ids, self.spec_k, c.prompt_lookup_max, c.prompt_lookup_min), 1.0

    def _may_speculate(self) -> bool:
        """Whether the next step may speculate: a speculative engine whose decoding sequences
        are no more than speculative_disable_by_batch_size (a prompt finishing its prefill may
        still push the step over it; that step then runs plain)."""
        if not self.spec_k:
            return False
        decoding = [s for s in self.scheduler.running if not s.prefilling]
        if self.spec_max_batch is not None and len(decoding) > self.spec_max_batch:
            return False
        if self.policy is not None:
            return self.policy.worth_trying([s.request_id for s in decoding])
        return True

    @staticmethod
    def _next_tokens(c) -> list[int]:
        """A prompt chunk's scoring targets: each position's next token, padded past the known
        tokens (those positions are not kept)."""
        ids = c.seq.all_ids[c.start + 1 : c.end + 1]
        return ids + [0] * (c.end - c.start - len(ids))

    def _score(self, c, r) -> None:
        """Fill a sequence's prompt_logprobs for the positions chunk c covers from its scores r."""
        seq, n = c.seq, c.seq.params.prompt_logprobs
        for j in range(min(c.end, len(seq.prompt_ids) - 1) - c.start):  # a recomputed output is not scored
            lp = {seq.all_ids[c.start + 1 + j]: float(r.logprobs[j])}
            for k in range(n):
                lp.setdefault(int(r.top_ids[j, k]), float(r.top_logprobs[j, k]))
            seq.prompt_logprobs[c.start + 1 + j] = lp
            seq.prompt_ranks[c.start + 1 + j] = int(r.ranks[j])

    def _prefill(self, chunks) -> None:
        """Fill KV for the plan's prompt chunks ahead of a speculative step (which verifies the
        decodes in a call of its own); chunks of sequences that ask for prompt logprobs are
        scored in the same device call."""
        targets = [self._next_tokens(c) if c.seq.wants_prompt_logprobs else None for c in chunks]
        results = self.runner.prefill(
            [Chunk(c.seq.all_ids[c.start : c.end], c.start, c.seq.pages) for c in chunks], targets
        )
        for c, r in zip(chunks, results):
            if r is not None:
                self._score(c, r)

    def _chunk(self, seq: Sequence, tokens: list[int], bitmask: np.ndarray | None = None, start: int | None = None):
        """A sampling row as the runner sees it: `tokens` from position `start` (default its last
        position: a decode row) through to its last token, where it samples, with its sampling
        controls and (constrained) its grammar's bitmask row for this step."""
        p = seq.params
        controls = None
        if p.controlled:
            penalty_ids, penalty_counts = seq.history.items() if seq.history is not None else ((), ())
            bias = p.logit_bias or {}
            controls = Controls(
                min_p=p.min_p,
                repetition_penalty=p.repetition_penalty,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                min_tokens=p.min_tokens,
                stop_ids=sorted(self.scheduler.eos | set(p.stop_token_ids)) if p.min_tokens else (),
                penalty_ids=penalty_ids,
                penalty_counts=penalty_counts,
                bias_ids=list(bias),
                bias_values=[-np.inf if b <= request_mod.BAN else b for b in bias.values()],
                bitmask=bitmask,
            )
        return Chunk(
            tokens,
            seq.length - 1 if start is None else start,
            seq.pages,
            (p.temperature, p.top_k, p.top_p, seq.seed, seq.num_generated),
            controls=controls,
        )

    def _dispatch(self, plan, num_steps: int = 1) -> "_PendingStep":
        """Hand one ragged step to the device without waiting for it: rows 0.. are the sequences
        that sample (a decode token, or a prompt's last chunk and its last token in one row),
        then the chunks of prompts still being filled. A sequence whose last token is still on
        the device (sampled by the previous step) is fed it there."""
        with phase(self.host_times, "build"):
            rows, feed, targets, scored = self._rows(plan)
        want_lp = any(s.params.logprobs is not None for s in plan.decodes)
        handle = self.runner.step_async(rows, want_lp, feed, targets, num_steps)
        return _PendingStep(handle, list(plan.decodes), scored)

    def _rows(self, plan) -> tuple[list[Chunk], list[int], list, list]:
        """The plan's rows for the runner, each decode row's feed (its row in the step in flight,
        or -1), each row's scoring targets (empty when none is scored) and the scored chunks."""
        seqs = plan.decodes
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        masks = None
        if constrained:  # every constrained row's allowed tokens, in one call
            t0 = time.perf_counter()
            masks = np.empty((len(constrained), self.grammars.words), np.int32)
            self.grammars.fill([seqs[i].grammar for i in constrained], masks)
            self.mask_seconds += time.perf_counter() - t0
            self.mask_steps += 1
        row_mask = dict(zip(constrained, masks if masks is not None else ()))
        prev_row = {id(s): i for i, s in enumerate(self._pending.seqs)} if self._pending is not None else {}
        chunk_of = {id(c.seq): c for c in plan.prefills}
        rows, feed, targets, scored = [], [], [], []
        for i, s in enumerate(seqs):
            c = chunk_of.pop(id(s), None)
            last = 0 if s.num_pending else s.all_ids[-1]
            if c is None:
                rows.append(self._chunk(s, [last], row_mask.get(i)))
            else:  # the prompt's last chunk and its last token: one row that samples
                rows.append(self._chunk(s, s.all_ids[c.start : c.end] + [last], row_mask.get(i), c.start))
            feed.append(prev_row[id(s)] if s.num_pending else -1)
            if c is not None and s.wants_prompt_logprobs:
                targets.append(self._next_tokens(c) + [0])
                scored.append((i, c))
            else:
                targets.append(None)
        for c in chunk_of.values():  # prompts still being filled: their rows sample nothing
            if c.seq.wants_prompt_logprobs:
                targets.append(self._next_tokens(c))
                scored.append((len(rows), c))
            else:
                targets.append(None)
            rows.append(Chunk(c.seq.all_ids[c.start : c.end], c.start, c.seq.pages))
        return rows, feed, targets if scored else [], scored

    def _resolve(self, step: "_PendingStep") -> list[Sequence]:
        """Wait for a dispatched step's tokens (and scores) and apply them."""
        with phase(self.host_times, "resolve"):
            return self._apply(step)

    def _apply(self, step: "_PendingStep") -> list[Sequence]:
        r = step.handle.result()
        for i, c in step.scored:
            self._score(c, r.prompt[i])
        out = {}
        if r.steps is not None:  # several decode steps: no logprobs
            for seq, ids in zip(step.seqs, r.steps.T.tolist()):
                out[seq.request_id] = [(t, None) for t in ids]
            return self.scheduler.apply(step.seqs, out)
        for i, seq in enumerate(step.seqs):
            n = seq.params.logprobs
            tok = int(r.tokens[i])
            lp = None
            if n is not None:  # the chosen token first, then the top n (which may include it)
                lp = {tok: float(r.logprobs[i])}
                for j in range(n):
                    lp.setdefault(int(r.top_ids[i, j]), float(r.top_logprobs[i, j]))
            out[seq.request_id] = [(tok, lp)]
        return self.scheduler.apply(step.seqs, out)

    def _lookup_rows(self, plan) -> list[Chunk] | str | None:
        """The plan as one ragged step with prompt-lookup drafts: each decoding sequence's row is
        [its prompt's last chunk..., last token, drafts...] (sampling rows first, in plan.decodes'
        order), then the chunks of prompts still being filled. None where that step does not
        apply: a draft model, a chunk to score, or more tokens than the largest bucket; "plain"
        where adaptive prompt lookup finds no draft that pays (a plain step serves it)."""
        if self.runner.draft is not None or any(c.seq.wants_prompt_logprobs for c in plan.prefills):
            return None
        chunk_of = {id(c.seq): c for c in plan.prefills}
        proposals = [self._propose(s) for s in plan.decodes]
        if self.policy is not None:
            counts = self.policy.choose([(len(d), a, 1.0) for d, a in proposals])
            if counts is None:
                return "plain"
            proposals = [(d[:n], a) for (d, a), n in zip(proposals, counts)]
        rows = []
        for s, (drafts, _) in zip(plan.decodes, proposals):
            c = chunk_of.pop(id(s), None)
            start = s.length - 1 if c is None else c.start
            row = self._chunk(s, s.all_ids[start:] + drafts, None, start)
            rows.append(dataclasses.replace(row, num_drafts=len(drafts)))
        rows += [Chunk(c.seq.all_ids[c.start : c.end], c.start, c.seq.pages) for c in chunk_of.values()]
        if sum(len(r.tokens) for r in rows) > self.runner.token_buckets[-1]:
            return None
        return rows

    def _speculate_ragged(self, seqs: list[Sequence], rows: list[Chunk]) -> dict[str, list[tuple[int, None]]]:
        out, n_out = self.runner.speculate_ragged(rows)
        result = {}
        for i, seq in enumerate(seqs):
            self.spec_stats.record(rows[i].num_drafts, int(n_out[i]))
            result[seq.request_id] = [(int(t), None) for t in out[i, : n_out[i]]]
        return result

    def _speculate(self, seqs: list[Sequence]) -> dict[str, list[tuple[int, None]]]:
        if self.runner.draft is None:
            rows = [self._chunk(s, [s.all_ids[-1]] + self._propose(s)[0]) for s in seqs]
        else:
            rows = [self._chunk(s, [s.all_ids[-1]]) for s in seqs]
        out, n_out, num_drafts = self.runner.speculate(rows)
        result = {}
        for i, seq in enumerate(seqs):
            self.spec_stats.record(int(num_drafts[i]), int(n_out[i]))
            result[seq.request_id] = [(int(t), None) for t in out[i, : n_out[i]]]
        return result

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
