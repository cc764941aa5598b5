"""Host-side request types: what users pass in (SamplingParams), what the scheduler tracks
(Sequence) and what users get back (RequestOutput). Plain Python, no jax."""

from __future__ import annotations

import dataclasses
import enum

MAX_LOGPROBS = 20  # top-n alternatives computed on the device: a static bound keeps one compile


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain an empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """One request as the scheduler sees it. Its KV lives in `pages`; tokens
    [0, num_computed) are in the cache, and the last token is fed by the next decode step."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    slot: int | None = None
    finish_reason: str | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """Tokens before the last still need their KV computed."""
        return self.num_computed < self.length - 1


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None = None
    num_cached_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
