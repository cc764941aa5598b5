"""The sampling fields a request carries, declared once for every frontend, and their one
mapping to the engine's `SamplingParams`.

The HTTP API's OpenAI bodies extend `SamplingFields` (serving/protocol.py), the gRPC frontend
reads its proto message into it (serving/grpc_server.py: the named proto fields, plus the
`controls` map for any field without its own number), and `jaxserve generate`/`client` make
their flags from it (cli.py). A field left None takes the engine's default. Values are judged
by `SamplingParams` alone, whose ValueError names the field first ("temperature must be ...");
every frontend turns that into its error (a 400 naming the parameter, INVALID_ARGUMENT, exit 2).

A new per-request control is a field here (with its description: the flag's help), a field of
`SamplingParams` (engine/request.py) and the sampler's use of it (runner/sampling.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxserve.engine.request import SamplingParams

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class SamplingFields(BaseModel):
    """Per-request sampling, as every frontend accepts it (None: the engine's default)."""

    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does

    max_tokens: int | None = Field(None, description="tokens to generate at most (default: the server's)")
    temperature: float | None = Field(None, description="0 is greedy (default 1)")
    top_p: float | None = Field(None, description="keep the most likely tokens holding this much probability (1: off)")
    n: int | None = Field(None, description="completions of each prompt (they share its KV pages)")
    seed: int | None = Field(None, description="sampling seed: the same seed and prompt give the same tokens")
    stop: str | list[str] | None = Field(None, description="a string that ends the output (repeatable)")
    presence_penalty: float | None = Field(None, description="OpenAI semantics over the output, in [-2, 2]")
    frequency_penalty: float | None = Field(None, description="OpenAI semantics over the output, in [-2, 2]")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]; -100 bans it")
    # Extensions beyond OpenAI's fields (vLLM has the same ones).
    top_k: int | None = Field(None, description="keep the k most likely tokens (0 or -1: off)")
    min_p: float | None = Field(None, description="keep tokens with probability >= min_p x the top one (0: off)")
    min_tokens: int | None = Field(None, description="EOS and stop tokens banned until this many tokens")
    repetition_penalty: float | None = Field(None, description="Hugging Face semantics over prompt and output; 1: off")
    ignore_eos: bool | None = Field(None, description="generate past the end-of-sequence token")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end the output (repeatable)")

    @classmethod
    def parse(cls, values: dict[str, Any]) -> "SamplingFields":
        """From a frontend's own names and values; ValueError naming the first bad field."""
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"{unknown[0]} is not a sampling field (known: {', '.join(cls.model_fields)})")
        try:
            return cls(**values)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{where}: {err['msg']}, got {err['input']!r}") from None


_MAPPED = tuple(k for k in SamplingFields.model_fields if k != "max_tokens")


def default_max_tokens(prompt_len: int, default: int, max_model_len: int) -> int:
    """max_tokens of a request that sets none: the server's default, or what the context has
    left after the prompt (at least 1, so an over-long prompt is refused by the engine's own
    check naming the prompt, not by a max_tokens the client never sent)."""
    return max(1, min(default, max_model_len - prompt_len))


def to_sampling_params(
    fields: SamplingFields,
    *,
    max_tokens: int | None,
    default_max: int,
    max_model_len: int,
    **extra: Any,
) -> Callable[[int], SamplingParams]:
    """Judge the fields now (before any tokenization) and return the builder of the request's
    SamplingParams as a function of its prompt length (max_tokens None: the default, or what
    the context leaves). `extra`: what a frontend says its own way (logprobs, prompt_logprobs,
    an output constraint); None and False are left out. A field the engine does not have is
    refused by name. Raises the engine's ValueError, which names the field."""
    given = {k: getattr(fields, k) for k in _MAPPED if getattr(fields, k) is not None}  # a subclass's own: not here
    given.update({k: v for k, v in extra.items() if v is not None and v is not False})
    for name in given:
        if name not in ENGINE_FIELDS:
            raise ValueError(f"{name} is not supported by this server")

    def build(prompt_len: int) -> SamplingParams:
        n = max_tokens if max_tokens is not None else default_max_tokens(prompt_len, default_max, max_model_len)
        return SamplingParams(max_tokens=n, **given)

    try:
        build(0)
    except TypeError as e:  # a value SamplingParams' checks could not compare
        raise ValueError(str(e)) from None
    return build
