"""A request's way into an engine and its text out, the same for the jitted core and the fake.

Validation and tokenization (every refusal a ValueError naming the field, raised before anything
is scheduled); the thread-safe hand-over to the engine loop (frontends call `add` and `abort` from
their worker threads, the loop drains the inbox at the start of its next step); a request's n
completions; each step's output deltas, detokenized, with stop strings applied; the page and
cache counts of `stats()`. One implementation, so the fake engine's frontend tests see exactly
what the real engine refuses and reports. Plain Python, no jax.
"""

from __future__ import annotations

import itertools
import numbers
import queue
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from typing import Sequence as Seq

import numpy as np

from jaxserve.engine import request as request_mod
from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.contract import completion_ids
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence, Status
from jaxserve.engine.tokenizer import IncrementalDetokenizer


def token_ids(prompt: object) -> list[int]:
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


def completions(seq: Sequence) -> list[Sequence]:
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


class Intake:
    """Mixed into an engine, which provides `tokenizer`, `model_path`, `vocab_size`,
    `max_model_len`, `cfg` (an EngineConfig), `scheduler`, `kv`, `_decoder` (a FastDecode, or
    None without a tokenizer) and `grammar(params)` (the constraint's state, or a ValueError
    naming it), and calls `_init_intake(seed)`."""

    tokenizer: Any
    model_path: Path
    vocab_size: int
    max_model_len: int

    def _init_intake(self, seed: int) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # The ids of every completion added and not yet finished (under _lock: add is called from
        # other threads): a new request may not reuse any of them.
        self._live_ids: set[str] = set()
        self._arrival = itertools.count()
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._detok: dict[str, IncrementalDetokenizer] = {}

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
        ids = token_ids(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        self.check_in_vocab("prompt_token_ids", ids)
        return ids

    def check_in_vocab(self, name: str, ids: Seq[int]) -> None:
        """ValueError naming `name` when a token id lies outside the vocabulary."""
        v = self.vocab_size
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
        grammar = self.grammar(params)
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

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns pages freed."""
        return self.kv.flush_prefix_cache()

    # -- the loop's side ---------------------------------------------------------------
    def _drain_inbox(self) -> list[Sequence]:
        """Apply the adds and aborts queued from any thread (the loop is the only writer of
        scheduler state); returns the sequences the aborts finished."""
        finished: list[Sequence] = []
        while not self._inbox.empty():
            op, arg = self._inbox.get()
            if op == "add":  # its ids are unique among the live ones (`add` checked)
                stop_ids = self.scheduler.eos | set(arg.params.stop_token_ids)
                for seq in completions(arg):
                    self._detok[seq.request_id] = IncrementalDetokenizer(self._decoder, stop_ids)
                    self.scheduler.add(seq)
            elif op == "abort":  # every completion of the request
                finished.extend(self.scheduler.abort(arg))
        return finished

    def _output(self, seq: Sequence) -> RequestOutput:
        """A touched sequence's delta since its last one; a stop string finishes it here."""
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

    def _pool_stats(self) -> dict:
        """The scheduler's, the page pool's and the prefix cache's part of `stats()`."""
        pc, alloc, local = self.kv.prefix_cache, self.kv.alloc, self.kv.local
        sliding = {}
        if local is not None:  # the sliding layers' pool (pages out of their window are freed)
            sliding = {"kv_local_pages_total": local.capacity, "kv_local_pages_free": local.num_free}
        return {
            **sliding,
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
        }
