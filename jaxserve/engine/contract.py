"""The engine contract: what the frontends (`EngineClient`, the servers, the offline `LLM`) call on an
engine core, and what each call promises.

`EngineCore` (the jitted engine) and `FakeEngine` (fake_engine.py: deterministic tokens, no jax)
both satisfy it, so a frontend test can run on either and a frontend cannot tell them apart: both
take `Sequence`s made by their own `make_sequence` and return `RequestOutput` deltas
(engine/request.py). Anything else on a core (its scheduler, KV manager, runner) is the core's
own business; a frontend that reaches past this Protocol is coupled to one implementation.

Threads: `make_sequence`/`tokenize`/`render_chat`/`check_in_vocab`, `add`, `abort`, `any_live`
and `stats` may be called from any thread; `step` (and `has_unfinished`, `num_running` as it
reads) from the one thread that steps the engine (EngineClient's loop, or LLM's caller).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from typing import Sequence as Seq

from jaxserve.engine.chat import Conversation
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence

# The keys of `Engine.stats()` every engine reports (the Prometheus gauges and the routers'
# /get_load read them); a speculative engine adds its own after these.
STATS_KEYS = (
    "running",
    "waiting",
    "kv_pages_total",
    "kv_pages_free",
    "kv_pages_used",
    "kv_pages_active",
    "preemptions",
    "prefix_cache_hit_tokens",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_rate",
    "prefix_cache_pages",
    "grammar_mask_seconds",
    "grammar_mask_steps",
    "overlapped_steps",
    "multi_step_calls",
    "multi_step_steps",
)


def completion_ids(request_id: str, n: int) -> list[str]:
    """The request ids of a request's n completions: its own, then `id#1` .. `id#(n-1)` (what
    `add` refuses while live, what `any_live` is asked about)."""
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


@runtime_checkable
class Engine(Protocol):
    """An engine core as its frontends see it."""

    cfg: EngineConfig  # the options it was built with (frontends read tool_call_parser)
    model_path: Path  # the checkpoint it serves (its name is the served model's name)
    max_model_len: int  # prompt + output tokens of one request, at most
    tokenizer: Any | None  # a transformers tokenizer, or None: token-id prompts only

    # -- prompts (any thread) -----------------------------------------------------------
    def tokenize(self, prompt: str | Seq[int] | Conversation) -> list[int]:
        """A prompt's token ids, validated (not empty, in the vocabulary, text only with a
        tokenizer); ValueError naming the field (`prompt`, `prompt_token_ids`, `messages`)."""
        ...

    def render_chat(self, messages: Conversation | Seq[dict]) -> list[int]:
        """A conversation's prompt ids by the checkpoint's chat template; ValueError naming `messages`."""
        ...

    def check_in_vocab(self, name: str, ids: Seq[int]) -> None:
        """ValueError naming `name` when a token id lies outside the vocabulary."""
        ...

    def make_sequence(
        self, prompt: str | Seq[int] | Conversation, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        """Validate and tokenize a request before anything is scheduled: ValueError naming the
        field (the prompt plus max_tokens past max_model_len names `max_tokens`). A missing id is
        made up; a missing seed is drawn, so the request is reproducible from its Sequence."""
        ...

    # -- requests (any thread) ----------------------------------------------------------
    def add(self, seq: Sequence) -> str:
        """Queue a sequence made by make_sequence; returns its id. ValueError naming request_id when
        any of its n completions' ids (`id`, `id#1`, ...) is still live."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort every completion of the request at the start of the next step: each ends with
        finish_reason "abort", and its slot and pages are free after that step. Unknown ids are ignored."""
        ...

    def any_live(self, ids: Iterable[str]) -> bool:
        """Whether any of these completion ids is added and not yet finished."""
        ...

    # -- the loop (the stepping thread) --------------------------------------------------
    def has_unfinished(self) -> bool:
        """Work is left: requests queued, waiting, running or a step in flight (step again)."""
        ...

    @property
    def num_running(self) -> int:
        """Completions holding a slot now (the client's waiting-queue bound counts the rest)."""
        ...

    def step(self) -> list[RequestOutput]:
        """One step: each request it touched, as the delta since its last output (new token ids,
        text, logprobs; `finish_reason` set on its last). Stop strings never reach the text in
        part; the n completions of a request carry its id and their `index`. An exception means
        the engine's state can no longer be trusted (the client fails everything in flight)."""
        ...

    # -- reports ------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters and gauges after the last step: every key in STATS_KEYS, numbers only."""
        ...

    def model_info(self) -> ModelInfo:
        """The served model."""
        ...

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns the pages freed."""
        ...

    def compiles_since_warmup(self) -> int:
        """Programs compiled since warm-up (0 while serving is the promise; a fake always says 0)."""
        ...

    @property
    def is_follower(self) -> bool:
        """Another host's process of a multi-host engine: it replays the leader and serves nothing."""
        ...

    def shutdown(self) -> None:
        """Release what outlives the process's frontends (a multi-host engine's followers)."""
        ...
