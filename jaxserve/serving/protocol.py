"""The OpenAI API as the HTTP frontend reads and answers it: the request bodies (pydantic
types only: the values are the engine's to judge), OpenAI's error body, and the per-request
records the endpoints pass around (`Call`, `CompletionChoice`).

Shared by the endpoint modules (chat_endpoint.py, completions_endpoint.py) and the frontend
(http_server.py), which routes to them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from jaxserve.engine import sampling_request
from jaxserve.engine.request import SamplingParams
from jaxserve.engine.sampling_request import SamplingFields
from jaxserve.engine.tool_calls import ToolRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each is its own engine request)


# -- errors ---------------------------------------------------------------------------
class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str, message: str) -> APIError:
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param, code="invalid_value")


# The engine's ValueError names its field first ("temperature must be >= 0", "messages[1].role: ...");
# the OpenAI parameter it came from, where the names differ.
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")


def param_of(message: str, renames: dict[str, str]) -> str | None:
    m = _FIELD.match(message)
    if m is None:
        return None
    name = m.group(1).rstrip(":.")
    return renames.get(name, name)


def validation_param(loc: tuple) -> str | None:
    """The request field a pydantic error is about: `temperature`, `messages[2].content`."""
    parts = [p for p in loc[1:]] if loc and loc[0] == "body" else list(loc)
    if not parts or not isinstance(parts[0], str):
        return None
    out = parts[0]
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("role", "content", "include_usage", "type", "text"):
            out += f".{p}"
        else:  # a union branch's tag ("str", "list[int]"): the field is named enough
            break
    return out


# -- request bodies (types only: the values are the engine's to judge) -----------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: dict | None = None


class SamplingRequest(SamplingFields):
    """The sampling fields every frontend shares (engine/sampling_request.py), and OpenAI's own."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs tokens as "token_id:N" (vLLM's)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extension


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


@dataclasses.dataclass
class Call:
    """One request as the handlers pass it around."""

    kind: str  # "chat" | "completion"
    body: Any
    prompt: Any
    params: Callable[[int], SamplingParams]
    renames: dict[str, str]
    logprobs: int | None
    include_usage: bool
    tools: ToolRequest | None = None  # a chat request's tools, parsed from its replies unless tool_choice is none
    id: str = ""
    created: int = 0
    # /v1/completions only
    prompts: list = dataclasses.field(default_factory=list)  # one engine request each
    echo: bool = False
    drop_output: bool = False  # max_tokens 0 with echo: the engine's one token is not returned
    prompt_logprobs: int | None = None  # the vLLM field asked for (echo's logprobs come from the same scores)


@dataclasses.dataclass
class CompletionChoice:
    """One completions choice being assembled (or streamed): what was sent so far."""

    prompt: int  # which prompt of the request
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    offset: int = 0  # text_offset of the next token (streaming)
    echoed: bool = False


def usage_body(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def engine_error(e: Exception, renames: dict[str, str]) -> APIError:
    """The engine's ValueError as a 400 naming the request's parameter (renames: engine field
    names -> this endpoint's parameter names)."""
    msg = str(e)
    param = param_of(msg, renames)
    return invalid(param, msg) if param else APIError(400, msg)


def to_sampling_params(
    b: SamplingRequest,
    max_tokens: int | None,
    default_max: int,
    max_model_len: int,
    logprobs: int | None,
    renames: dict[str, str],
    grammar: str | None = None,
) -> Callable[[int], SamplingParams]:
    """The shared mapping (sampling_request.to_sampling_params) with what only the HTTP API says
    its own way: stream_options, response_format, logprobs and a tool call's grammar. Errors
    are 400s naming the parameter (renames: engine field names -> this endpoint's names)."""
    if b.stream_options is not None and not b.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    extra: dict[str, Any] = {
        "logprobs": logprobs,
        "grammar": grammar,
    }  # a tool call's (tool_choice required or a function)
    if isinstance(b, ChatCompletionRequest) and b.response_format is not None:
        rf = b.response_format
        if grammar is not None and rf.type != "text":
            raise invalid(
                "response_format", "response_format cannot be combined with tool_choice required or a function"
            )
        if rf.type == "json_object":
            extra["json_object"] = True
        elif rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if schema is None:
                raise invalid("response_format", "response_format.json_schema.schema is required")
            extra["json_schema"] = schema
        elif rf.type != "text":
            raise invalid(
                "response_format", f"response_format.type must be text, json_object or json_schema, got {rf.type!r}"
            )
    try:
        return sampling_request.to_sampling_params(
            b, max_tokens=max_tokens, default_max=default_max, max_model_len=max_model_len, **extra
        )
    except ValueError as e:
        if str(e).startswith(("json_object ", "json_schema ")):  # "... is not supported by this server"
            raise invalid("response_format", "response_format is not supported by this server") from None
        raise engine_error(e, renames) from None
