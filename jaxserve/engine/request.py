"""Host-side request types: what users pass in (SamplingParams), what the scheduler tracks
(Sequence) and what users get back (RequestOutput). Plain Python, no jax."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import json
import math
import numbers
from typing import Any, Mapping

MAX_LOGPROBS = 20  # top-n alternatives computed on the device: a static bound keeps one compile
MAX_LOGIT_BIAS = 64  # logit_bias entries per request: the device takes a fixed [rows, 64] list
INT32_MAX = 2**31 - 1  # counts and ids the device step holds as int32
MAX_STOP_IDS = 16  # EOS + stop_token_ids masked while min_tokens is not reached: a fixed [rows, 16] list
PENALTY_TOKENS = 256  # the most recent distinct tokens (prompt and output) the penalties see
MAX_N = 64  # completions of one prompt
BAN = -100.0  # a logit_bias at this value bans the token (OpenAI's documented meaning)
CONSTRAINTS = ("json_schema", "regex", "grammar", "json_object")


def _number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite float in [lo, hi] (or (lo, hi]); ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
    return v


def _integer(name: str, value: Any, lo: int, hi: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}{what}, got {value!r}")
    return int(value)


def _control(default: float) -> Any:
    return dataclasses.field(default=default, metadata={"row_control": True})


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Penalties follow Hugging Face (repetition_penalty, over prompt and
    output) and OpenAI (presence/frequency, over the output); at most one output constraint
    (json_schema, regex, grammar, json_object) applies. See docs/sampling.md."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's prompt_logprobs: each prompt token's logprob (the first is None: nothing predicts
    # it) with the top n alternatives, computed in the prefill. A request that asks for them
    # skips the prefix cache (its cached tokens would have no logits), as vLLM does.
    prompt_logprobs: int | None = None
    n: int = 1
    # Per-row scalar controls of the sampler (runner/sampling.py ROW_CONTROLS, with the same
    # defaults: each an exact no-op there); one away from its default makes a row `controlled`.
    min_p: float = _control(0.0)
    min_tokens: int = 0
    repetition_penalty: float = _control(1.0)
    presence_penalty: float = _control(0.0)
    frequency_penalty: float = _control(0.0)
    logit_bias: Mapping[int, float] | None = None
    json_schema: str | dict | None = None  # a JSON Schema (text or dict); kept as canonical JSON text
    regex: str | None = None
    grammar: str | None = None  # Lark, or GBNF (converted to Lark)
    json_object: bool = False  # any JSON object

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        set_("stop_token_ids", tuple(_integer("stop_token_ids", t, 0) for t in self.stop_token_ids))
        # Counts and ids reach the device step as int32: anything larger is refused here, where the
        # request alone fails, not in the step, where every request in flight would.
        set_("max_tokens", _integer("max_tokens", self.max_tokens, 1, INT32_MAX))
        set_("temperature", _number("temperature", self.temperature, 0.0, 1e6))
        off = isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool) and self.top_k == -1
        top_k = 0 if off else self.top_k  # -1: vLLM's "off"
        set_("top_k", _integer("top_k", top_k, 0, INT32_MAX, what=" (0 or -1 disables it)"))
        set_("top_p", _number("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed, 0, 2**63 - 1))
        if self.logprobs is not None:
            set_("logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            set_("prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        set_("n", _integer("n", self.n, 1, MAX_N))
        set_("min_p", _number("min_p", self.min_p, 0.0, 1.0))
        set_("min_tokens", _integer("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)"))
        set_("repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0, 1e3, lo_open=True))
        set_("presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        if self.logit_bias is not None:
            items = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
            bias = {}
            for k, v in items:
                tid = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k  # JSON keys are text
                bias[_integer("logit_bias", tid, 0, what=" (a token id)")] = _number(
                    f"logit_bias[{tid}]", v, -100.0, 100.0
                )
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
            set_("logit_bias", bias or None)
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.json_object, bool):
            raise ValueError("ignore_eos and json_object must be booleans")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json_schema: not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
            set_("json_schema", json.dumps(schema, separators=(",", ":")))  # key order kept: it is the output order
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")
        given = [c for c in CONSTRAINTS if getattr(self, c) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one of {', '.join(CONSTRAINTS)} may be set, got {', '.join(given)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None."""
        for c in CONSTRAINTS:
            v = getattr(self, c)
            if v not in (None, False):
                return (c, "" if v is True else v)
        return None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def controlled(self) -> bool:
        """Uses a control beyond temperature/top-k/top-p/seed (the device gets a Controls row).
        Asked for every row every step: computed once (the parameters are frozen)."""
        return (
            self.constraint is not None
            or self.min_tokens > 0
            or self.logit_bias is not None
            or any(getattr(self, name) != default for name, default in _ROW_DEFAULTS)
        )

    @property
    def plain_decode_only(self) -> bool:
        """Needs the plain decode step (speculative steps compute neither logprobs, masks,
        penalties nor biases): see docs/sampling.md."""
        return self.logprobs is not None or self.controlled


ROW_CONTROL_FIELDS = tuple(f for f in dataclasses.fields(SamplingParams) if f.metadata.get("row_control"))
_ROW_DEFAULTS = tuple((f.name, f.default) for f in ROW_CONTROL_FIELDS)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenHistory:
    """The most recent PENALTY_TOKENS distinct tokens of prompt and output, each with its count
    in the output: what the device's penalties read, kept in O(1) per token."""

    def __init__(self, prompt_ids, output_ids=()):
        self._d: collections.OrderedDict[int, int] = collections.OrderedDict()
        for t in prompt_ids:
            self._see(t, 0)
        for t in output_ids:
            self.add(t)

    def _see(self, token: int, inc: int) -> None:
        d = self._d
        d[token] = d.pop(token, 0) + inc
        if len(d) > PENALTY_TOKENS:
            d.popitem(last=False)

    def add(self, token: int) -> None:
        self._see(token, 1)

    def items(self):
        """(token ids, output counts) as int32 numpy arrays."""
        import numpy as np

        n = len(self._d)
        return np.fromiter(self._d.keys(), np.int32, n), np.fromiter(self._d.values(), np.int32, n)


@dataclasses.dataclass
class Sequence:
    """One request (one of its n completions) as the scheduler sees it. Its KV lives in `pages`;
    tokens [0, num_computed) are in the cache, and the last token is fed by the next decode step.
    The n completions of a request share `parent_id` (the request's id) and have their own
    `index`, `request_id` (the request's id for index 0, `id#i` after) and seed."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = dataclasses.field(default_factory=list)
    # A model with sliding-window layers: their pages (the local pool's), index for index with
    # `pages`; the dummy page where a page fell out of the window and was freed (kv_manager)
    local_pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    slot: int | None = None
    finish_reason: str | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    prompt_skips: int = 0  # steps this prompt was passed over by shorter ones (scheduler)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    index: int = 0
    parent_id: str | None = None  # None: request_id
    leader: "Sequence | None" = None  # index 0 of the same request (for index > 0): its prompt pages are forked
    grammar: Any = None  # structured.GrammarState of a constrained request
    history: TokenHistory | None = None  # for penalized requests
    # Tokens a dispatched decode step is sampling that the host has not read yet (async
    # scheduling, at most one between steps): they count in `length` (pages, positions)
    # but are not in output_ids until `append` fills them in.
    num_pending: int = 0
    # params.prompt_logprobs: position i's logprobs dict (the prompt token first, then the top
    # n), filled by the prefill chunks; position 0 stays None. Sent with the first output.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in the vocabulary (1: most likely)
    prompt_logprobs_sent: bool = False

    def __post_init__(self):
        if self.parent_id is None:
            self.parent_id = self.request_id
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
            self.prompt_ranks = [None] * len(self.prompt_ids)
        if self.params.penalized and self.history is None:
            self.history = TokenHistory(self.prompt_ids, self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Output tokens, those still on the device included."""
        return len(self.output_ids) + self.num_pending

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step needs its last token on the host (the grammar's mask, the penalties'
        history): its decode steps are not overlapped."""
        return self.grammar is not None or self.history is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must compute every prompt position's logits: no prefix-cache reuse."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent and self.leader is None

    @property
    def prefilling(self) -> bool:
        """Tokens before the last still need their KV computed."""
        return self.num_computed < self.length - 1

    def append(self, token: int) -> None:
        """A sampled token arrives (it replaces a pending one, if any)."""
        self.num_pending = max(0, self.num_pending - 1)
        self.output_ids.append(token)
        if self.history is not None:
            self.history.add(token)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None = None
    num_cached_prompt_tokens: int = 0
    index: int = 0  # which of the request's n completions
    tool_calls: list | None = None  # LLM.chat with tools: the reply's tool_calls.ToolCall list, text = the rest
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), in the
    # first output of each completion only
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __getattr__(self, name: str) -> Any:
        """`text` decoded when first read (only called when the attribute is missing): the
        engine defers the text of a request without stop strings to whoever reads it
        (IncrementalDetokenizer.delta), so text no caller reads is never decoded."""
        if name == "text":
            read = self.__dict__.get("_read_text")  # removed by read, once the text is set
            if read is not None:
                read(self)
                return self.__dict__["text"]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict:
        self.text  # noqa: B018 -- a deferred text is decoded before the output is copied or sent
        return self.__dict__
