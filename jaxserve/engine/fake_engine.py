"""A fake engine core for frontend tests: the engine contract (contract.Engine) with the real
scheduler, KV manager, prefix cache, detokenizer and request types, and a fake model whose
tokens are a fixed function of the prompt, so no jax is imported and nothing compiles.

What the frontends see is what the jitted core gives them: `RequestOutput` deltas with text from a
real tokenizer (a word-level one built in memory: token i is the word "w<i>", ids 0-2 are <s>,
</s>, <unk>), stop strings held back and cut, stop token ids, EOS, max_tokens and max_model_len,
n completions, aborts that free pages at the next step, prefix-cache hits, logprobs and prompt
logprobs, `stats()` and `model_info()` with the core's keys and fields. A test knows every token
before it asks (`FakeModel.tokens`), so the oracle of a frontend test is the model function and
the invariants of the pool, not a second engine run.

What it does not do: sampling (temperature, top-k/p, seeds, penalties and biases are validated
and ignored: every request decodes the model function) and output constraints (refused with a
ValueError naming the field). `step_seconds` stands in for the device's step time, so a stream
lasts long enough for a test to disconnect from it.
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
from typing import Any
from typing import Sequence as Seq

import numpy as np

from jaxserve.engine import request as request_mod
from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.contract import ModelInfo, completion_ids
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence, Status
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.tokenizer import FastDecode, IncrementalDetokenizer, word_tokenizer

BOS, EOS, FIRST_WORD = 0, 1, 3  # the word tokenizer's <s>, </s>; <unk> is 2; words from 3

# Role and content as words, so a conversation's ids are its words' (a template the fake serves).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


@dataclasses.dataclass(frozen=True)
class FakeModel:
    """The fake's weights: output token i of completion `index` of a prompt is a fixed function
    of the prompt's ids, the index and i, always a word (>= FIRST_WORD); `eos_at`: completions
    emit EOS as their output token number eos_at instead (None: never)."""

    vocab_size: int = 512
    eos_at: int | None = None

    def token(self, prompt_ids: Seq[int], index: int, i: int) -> int:
        if self.eos_at is not None and i == self.eos_at - 1:
            return EOS
        h = 31 * sum(prompt_ids) + 7 * len(prompt_ids) + 101 * index + 13 * i
        return FIRST_WORD + h % (self.vocab_size - FIRST_WORD)

    def tokens(self, prompt_ids: Seq[int], n: int, index: int = 0) -> list[int]:
        """The first n output tokens (what a request gets before any stop applies)."""
        return [self.token(prompt_ids, index, i) for i in range(n)]

    def logprobs(self, token: int, top: int) -> dict[int, float]:
        """The chosen token first and most likely (-0.25), then top - 1 others, each a nat less
        likely than the one before: a step's logprobs dict as the core returns it."""
        span = self.vocab_size - FIRST_WORD
        others = [FIRST_WORD + (token - FIRST_WORD + k) % span for k in range(1, top)]
        return {token: -0.25, **{t: -0.25 - k for k, t in enumerate(others, start=1)}}


class FakeEngine:
    """The engine contract over a fake model. Build it with the core's options (EngineConfig:
    max_slots, page_size, max_model_len, num_pages, token_buckets, enable_prefix_caching, ...)."""

    def __init__(self, model: FakeModel | None = None, *, name: str = "fake", step_seconds: float = 0.002, **options):
        self.model = model or FakeModel()
        self.cfg = EngineConfig(**options)
        self.model_path = Path(name)
        self.max_model_len = self.cfg.max_model_len or 2048
        self.step_seconds = step_seconds
        self.tokenizer: Any | None = word_tokenizer(self.model.vocab_size, specials=True)
        self.tokenizer.chat_template = CHAT_TEMPLATE
        page = self.cfg.page_size
        num_pages = self.cfg.num_pages or self.cfg.max_slots * -(-self.max_model_len // page) + 1
        budget = self.cfg.max_num_batched_tokens or (self.cfg.token_buckets or (256,))[-1]
        allocator = PageAllocator(num_pages, page)
        self.kv = KVManager(allocator, RadixCache(allocator) if self.cfg.enable_prefix_caching else None)
        self.scheduler = Scheduler(
            self.kv,
            self.cfg.max_slots,
            self.max_model_len,
            max_num_batched_tokens=budget,
            eos_token_ids=(EOS,),
            max_prefill_tokens_while_decoding=self.cfg.max_prefill_tokens_while_decoding,
            token_buckets=self.cfg.token_buckets or (budget,),
        )
        self._decoder = FastDecode(self.tokenizer)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live_ids: set[str] = set()
        self._arrival = itertools.count()
        self._rng = np.random.default_rng(self.cfg.seed)
        self._lock = threading.Lock()

    # -- prompts --------------------------------------------------------------------------
    def render_chat(self, messages: Conversation | Seq[dict]) -> list[int]:
        return render(self.tokenizer, Conversation.of(messages), self.model_path)

    def tokenize(self, prompt: str | Seq[int] | Conversation) -> list[int]:
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
        v = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {v})")

    def make_sequence(
        self, prompt: str | Seq[int] | Conversation, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
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
        for name, tids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            self.check_in_vocab(name, tids)
        if params.min_tokens and len({EOS, *params.stop_token_ids}) > request_mod.MAX_STOP_IDS:
            raise ValueError(
                f"min_tokens: with min_tokens set, EOS and stop_token_ids may hold at most "
                f"{request_mod.MAX_STOP_IDS} ids together"
            )
        if params.constraint is not None:
            raise ValueError(f"{params.constraint[0]}: the fake engine does not constrain its outputs")
        with self._lock:  # frontends validate in worker threads
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
            arrival = next(self._arrival)
        rid = request_id or uuid.uuid4().hex
        return Sequence(request_id=rid, prompt_ids=ids, params=params, seed=seed, arrival=arrival)

    # -- requests -------------------------------------------------------------------------
    def any_live(self, ids: Iterable[str]) -> bool:
        with self._lock:
            return not self._live_ids.isdisjoint(ids)

    def add(self, seq: Sequence) -> str:
        ids = completion_ids(seq.request_id, seq.params.n)
        with self._lock:
            taken = next((rid for rid in ids if rid in self._live_ids), None)
            if taken is not None:
                raise ValueError(f"request_id: {taken!r} is already in use")
            self._live_ids.update(ids)
        self._inbox.put(("add", seq))
        return seq.request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Take the inbox, plan with the real scheduler, "run" the plan (sleep step_seconds, the
        fake model's tokens), apply it, and return each touched request's delta."""
        finished_now: list[Sequence] = []
        while not self._inbox.empty():
            op, arg = self._inbox.get()
            if op == "add":
                for seq in self._completions(arg):
                    self._detok[seq.request_id] = IncrementalDetokenizer(
                        self._decoder, {EOS, *seq.params.stop_token_ids}
                    )
                    self.scheduler.add(seq)
            else:
                finished_now.extend(self.scheduler.abort(arg))
        plan = self.scheduler.schedule()
        if not plan.empty and self.step_seconds:
            time.sleep(self.step_seconds)
        for chunk in plan.prefills:
            self._score_prompt(chunk.seq, chunk.start, chunk.end)
        sampled = {s.request_id: [self._sample(s)] for s in plan.decodes}
        touched = self.scheduler.update(plan, sampled)
        once = list({id(s): s for s in touched + finished_now}.values())
        return [self._output(seq) for seq in once]

    def _completions(self, seq: Sequence) -> list[Sequence]:
        """The n sequences of a request: `seq`, then ones sharing its prompt (forked pages)."""
        out = [seq]
        for i, rid in enumerate(completion_ids(seq.request_id, seq.params.n)[1:], start=1):
            out.append(
                Sequence(
                    request_id=rid,
                    prompt_ids=seq.prompt_ids,
                    params=seq.params,
                    seed=seq.seed + i,
                    arrival=seq.arrival,
                    index=i,
                    parent_id=seq.request_id,
                    leader=seq,
                )
            )
        return out

    def _sample(self, seq: Sequence) -> tuple[int, dict[int, float] | None]:
        token = self.model.token(seq.prompt_ids, seq.index, len(seq.output_ids))  # EOS too: ignore_eos keeps it
        lp = seq.params.logprobs
        return token, (self.model.logprobs(token, max(lp, 1)) if lp is not None else None)

    def _score_prompt(self, seq: Sequence, start: int, end: int) -> None:
        """Prompt logprobs of positions [start, end) + 1 (a prefill chunk predicts the next token)."""
        if seq.prompt_logprobs is None:
            return
        top = max(seq.params.prompt_logprobs, 1)
        for pos in range(max(start, 0) + 1, min(end + 1, len(seq.prompt_ids))):
            seq.prompt_logprobs[pos] = self.model.logprobs(seq.prompt_ids[pos], top)
            seq.prompt_ranks[pos] = 1

    def _output(self, seq: Sequence) -> RequestOutput:
        d = self._detok[seq.request_id]
        if d.update(seq):  # a stop string: the text ends before it
            if seq.finish_reason == "length":
                seq.finish_reason = "stop"
            self.scheduler.finish(seq, "stop")
        out = d.delta(seq)
        out.request_id, out.index = seq.parent_id, seq.index
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            src = seq.leader or seq
            out.prompt_logprobs, out.prompt_ranks = src.prompt_logprobs, src.prompt_ranks
            seq.prompt_logprobs_sent = True
        if seq.status is Status.FINISHED:
            self._detok.pop(seq.request_id, None)
            with self._lock:
                self._live_ids.discard(seq.request_id)
        return out

    # -- reports --------------------------------------------------------------------------
    def stats(self) -> dict:
        pc, alloc = self.kv.prefix_cache, self.kv.alloc
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": alloc.capacity,
            "kv_pages_free": alloc.num_free,
            "kv_pages_used": alloc.capacity - alloc.num_free,
            "kv_pages_active": len({p for s in self.scheduler.running for p in s.pages}),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": pc.hit_tokens if pc else 0,
            "prefix_cache_queried_tokens": pc.queried_tokens if pc else 0,
            "prefix_cache_hit_rate": pc.hit_rate if pc else 0.0,
            "prefix_cache_pages": pc.num_cached_pages if pc else 0,
            "grammar_mask_seconds": 0.0,
            "grammar_mask_steps": 0,
            "overlapped_steps": 0,
            "multi_step_calls": 0,
            "multi_step_steps": 0,
        }

    def model_info(self) -> ModelInfo:
        features = ["attention:fake", "matmul:fake", "kv_cache:fake"]
        if self.kv.prefix_cache is not None:
            features.append("prefix_caching")
        return ModelInfo(
            self.model_path.name,
            self.max_model_len,
            self.model.vocab_size,
            tuple(features),
            self.cfg.max_slots,
            self.cfg.page_size,
            self.kv.capacity,
            self.tokenizer is not None,
        )

    def flush_prefix_cache(self) -> int:
        return self.kv.flush_prefix_cache()

    def compiles_since_warmup(self) -> int:
        return 0  # nothing compiles

    @property
    def is_follower(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


def _token_ids(prompt: object) -> list[int]:
    """A prompt of token ids as a list of ints; ValueError naming `prompt_token_ids` (or `prompt`),
    with the core's messages."""
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
