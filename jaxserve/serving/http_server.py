"""The OpenAI-compatible HTTP frontend: GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (streamed as server-sent events ending in `data: [DONE]`, or not), GET
/health, vLLM's POST /tokenize and /detokenize, and GET /metrics (Prometheus: jaxserve's and
vLLM's names, metrics.py).

/v1/completions serves evaluation harnesses (lm-eval's `local-completions`) as vLLM does:
prompt lists (each prompt its own choices, index = prompt * n + completion), token-id
prompts, `echo` (max_tokens 0 allowed) with `logprobs` over the echoed prompt tokens (the
first one's null) and vLLM's `prompt_logprobs`; the engine scores the prompt in its prefill.

FastAPI on uvicorn, run by `Server` (server.py) in the same asyncio event loop as the gRPC
frontend, over the same EngineClient: one engine, one scheduler, one set of metrics, one drain.
Like the gRPC handlers, these know requests, not arrays: they validate the OpenAI fields, submit
(tokenization and chat-template rendering run in the engine client's worker thread), format
the engine's RequestOutput deltas as OpenAI JSON, and abort the request when the client goes
away. Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 naming
the field at fault, 401 without the configured bearer token, 404 for an unknown model, 429 when
the waiting queue is full, 503 while draining or after an engine failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import socket
import ssl
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict
from sse_starlette import EventSourceResponse

from jaxserve.engine.chat import Conversation
from jaxserve.engine.client import EngineClient, EngineDead, QueueFull, RequestStream, TokenLogprob, split_logprobs
from jaxserve.engine.request import RequestOutput, SamplingParams
from jaxserve.engine.tool_calls import ToolCalling, ToolRequest, finish_reason
from jaxserve.serving import routing
from jaxserve.serving.lifecycle import RequestLife, default_max_tokens
from jaxserve.serving.metrics import Metrics

log = logging.getLogger("jaxserve.http")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each is its own engine request)
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


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


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param, code="invalid_value")


# The engine's ValueError names its field first ("temperature must be >= 0", "messages[1].role: ...");
# the OpenAI parameter it came from, where the names differ.
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)")


def _param_of(message: str, renames: dict[str, str]) -> str | None:
    m = _FIELD.match(message)
    if m is None:
        return None
    name = m.group(1).rstrip(":.")
    return renames.get(name, name)


def _validation_param(loc: tuple) -> str | None:
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


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions beyond OpenAI's fields (vLLM has the same ones).
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs tokens as "token_id:N"


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
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
class _Call:
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
class _CompletionChoice:
    """One completions choice being assembled (or streamed): what was sent so far."""

    prompt: int  # which prompt of the request
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    offset: int = 0  # text_offset of the next token (streaming)
    echoed: bool = False


# -- the frontend -----------------------------------------------------------------------
class HttpFrontend:
    """The FastAPI app over an EngineClient, and the uvicorn server that runs it."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: Metrics,
        token: str | None = None,
        default_max_tokens: int = 256,
        tls: tuple[bytes, bytes] | None = None,
    ):
        self.engine, self.metrics = engine, metrics
        self.token = token
        self.default_max_tokens = default_max_tokens
        self.tls = tls
        info = engine.model_info()
        self.model_name, self.max_model_len = info.model_name, info.context_length
        self.page_size = info.page_size
        self.created = int(time.time())
        self.draining = False
        self._token_texts: dict[int, str] = {}
        self._tool_calling: ToolCalling | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        """Bind (port 0 picks a free one) and serve in the running event loop; returns the port."""
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        # log_config=None: uvicorn's default runs logging.config.dictConfig, which closes every
        # handler in the process (absl's closed the stream it held) and re-wires the root; its
        # records propagate to the process's own handlers instead.
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_level="warning",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        config.load()
        if self.tls is not None:
            config.ssl = _ssl_context(*self.tls)
        self._uvicorn = _Uvicorn(config)
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._task.done():  # it failed to start: raise why
                self._task.result()
                raise RuntimeError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            await self._task
            self._uvicorn = None

    # -- the app --------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="jaxserve", summary="OpenAI-compatible API of jaxserve", docs_url=None, redoc_url=None)
        auth = [Depends(self._authorize)]

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError):
            if e.status in (400, 429):
                self.metrics.requests.labels("invalid" if e.status == 400 else "rejected").inc()
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def _bad_body(request: Request, e: RequestValidationError):
            self.metrics.requests.labels("invalid").inc()
            err = e.errors()[0] if e.errors() else {}
            param = _validation_param(tuple(err.get("loc", ())))
            if err.get("type") == "json_invalid":
                param = None
            msg = err.get("msg", "invalid request body")
            return _invalid(param, msg).response() if param else APIError(400, msg).response()

        @app.get("/health")
        async def health():
            if self.engine.error is not None:
                raise APIError(503, f"the engine failed: {self.engine.error!r}", type_="service_unavailable")
            if self.draining:
                raise APIError(503, "the server is shutting down", type_="service_unavailable")
            return {"status": "ok"}

        @app.get("/v1/models", dependencies=auth)
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model:path}", dependencies=auth)
        async def model(model: str):
            self._check_model(model)
            return self._model_card()

        @app.post("/v1/chat/completions", dependencies=auth)
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            self._check_model(body.model)
            return await self._serve_chat(self._chat_call(body), request)

        @app.post("/v1/completions", dependencies=auth)
        async def completions(body: CompletionRequest, request: Request):
            self._check_model(body.model)
            return await self._serve_completion(self._completion_call(body), request)

        @app.post("/tokenize", dependencies=auth)
        async def tokenize(body: TokenizeRequest):
            return await self._tokenize(body)

        @app.post("/detokenize", dependencies=auth)
        async def detokenize(body: DetokenizeRequest):
            if body.model is not None:
                self._check_model(body.model)
            try:
                text = await asyncio.get_running_loop().run_in_executor(None, self.engine.detokenize, body.tokens)
            except ValueError as e:
                raise self._engine_error(e, {}) from None
            return {"prompt": text}

        @app.get("/tokenizer_info", dependencies=auth)
        async def tokenizer_info():
            try:
                return self.engine.tokenizer_info()
            except ValueError as e:
                raise self._engine_error(e, {}) from None

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        # the routers' endpoints: /live, /get_load, /v1/completions/render, /v1/chat/completions/render
        routing.add_routes(app, self, [self._authorize], CompletionRequest, ChatCompletionRequest, APIError)
        return app

    async def _authorize(self, request: Request) -> None:
        if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
            raise APIError(401, "missing or wrong bearer token (Authorization: Bearer <token>)", code="invalid_api_key")

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "jaxserve",
            "max_model_len": self.max_model_len,
        }

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                "model",
                code="model_not_found",
            )

    # -- requests -> SamplingParams ------------------------------------------------------
    def _sampling(
        self,
        b: _Sampling,
        max_tokens: int | None,
        default_max: int,
        logprobs: int | None,
        renames: dict[str, str],
        grammar: str | None = None,
    ) -> Callable[[int], SamplingParams]:
        """Validate the sampling fields now (before any tokenization) and return the builder of
        the request's SamplingParams as a function of its prompt length. renames: engine field
        names -> this endpoint's parameter names, for error messages."""
        if b.stream_options is not None and not b.stream:
            raise _invalid("stream_options", "stream_options is only allowed when stream is true")
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "seed", "top_k", "ignore_eos", "n"):
            if getattr(b, name) is not None:
                kw[name] = getattr(b, name)
        if b.stop is not None:
            kw["stop"] = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop)
        if b.stop_token_ids:
            kw["stop_token_ids"] = tuple(b.stop_token_ids)
        if logprobs is not None:
            kw["logprobs"] = logprobs
        # Fields that only matter at a value other than their default: passed to the engine when
        # its SamplingParams has them, refused by name when it does not.
        extra = {
            "presence_penalty": b.presence_penalty or None,
            "frequency_penalty": b.frequency_penalty or None,
            "min_p": b.min_p or None,
            "min_tokens": b.min_tokens or None,
            "repetition_penalty": b.repetition_penalty if b.repetition_penalty not in (None, 1.0) else None,
            "logit_bias": b.logit_bias or None,
            "grammar": grammar,  # a tool call's (tool_choice required or a function)
        }
        if extra["logit_bias"] is not None:
            try:
                extra["logit_bias"] = {int(k): v for k, v in b.logit_bias.items()}
            except ValueError:
                raise _invalid("logit_bias", "logit_bias keys must be token ids") from None
        if isinstance(b, ChatCompletionRequest) and b.response_format is not None:
            rf = b.response_format
            if grammar is not None and rf.type != "text":
                raise _invalid(
                    "response_format", "response_format cannot be combined with tool_choice required or a function"
                )
            if rf.type == "json_object":
                extra["json_object"] = True
            elif rf.type == "json_schema":
                schema = (rf.json_schema or {}).get("schema")
                if schema is None:
                    raise _invalid("response_format", "response_format.json_schema.schema is required")
                extra["json_schema"] = schema
            elif rf.type != "text":
                raise _invalid(
                    "response_format", f"response_format.type must be text, json_object or json_schema, got {rf.type!r}"
                )
        for name, value in extra.items():
            if value is None:
                continue
            if name not in _SAMPLING_FIELDS:
                param = "response_format" if name in ("json_object", "json_schema") else name
                raise _invalid(param, f"{param} is not supported by this server")
            kw[name] = value

        def build(prompt_len: int) -> SamplingParams:
            n = (
                max_tokens
                if max_tokens is not None
                else default_max_tokens(prompt_len, default_max, self.max_model_len)
            )
            return SamplingParams(max_tokens=n, **kw)

        try:
            build(0)  # judge the fields now, before the prompt is tokenized
        except (ValueError, TypeError) as e:
            raise self._engine_error(e, renames) from None
        return build

    def _engine_error(self, e: Exception, renames: dict[str, str]) -> APIError:
        msg = str(e)
        param = _param_of(msg, renames)
        return _invalid(param, msg) if param else APIError(400, msg)

    @property
    def tool_calling(self) -> ToolCalling:
        """The checkpoint's tool-call family and template support (tool_calls.py), built on first use."""
        if self._tool_calling is None:
            core = self.engine.core
            self._tool_calling = ToolCalling.for_tokenizer(core.tokenizer, core.cfg.tool_call_parser)
        return self._tool_calling

    def _chat_call(self, b: ChatCompletionRequest) -> _Call:
        try:
            tools = ToolRequest.of(b.tools, b.tool_choice, b.parallel_tool_calls)
        except ValueError as e:
            raise self._engine_error(e, {}) from None
        messages = []
        for i, m in enumerate(b.messages):
            content = m.content
            if isinstance(content, list):  # text parts only
                bad = [p.type for p in content if p.type != "text" or p.text is None]
                if bad:
                    raise _invalid(f"messages[{i}].content", f"only text content parts are supported, got {bad[0]!r}")
                content = "\n".join(p.text for p in content)
            message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            message.update({k: getattr(m, k) for k in ("tool_calls", "tool_call_id", "name") if getattr(m, k)})
            messages.append(message)
        tc = self.tool_calling
        try:
            prompt = Conversation.of(tc.messages(Conversation.of(messages).messages, tools), tc.template_tools(tools))
            grammar = tc.grammar(tools)
        except ValueError as e:
            raise self._engine_error(e, {}) from None
        if b.top_logprobs is not None and not b.logprobs:
            raise _invalid("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (b.top_logprobs or 0) if b.logprobs else None
        max_tokens, max_name = (
            (b.max_completion_tokens, "max_completion_tokens")
            if b.max_completion_tokens is not None
            else (b.max_tokens, "max_tokens")
        )
        renames = {"max_tokens": max_name, "logprobs": "top_logprobs", "prompt": "messages", "grammar": "tool_choice"}
        params = self._sampling(b, max_tokens, self.default_max_tokens, logprobs, renames, grammar)
        include_usage = bool(b.stream and b.stream_options and b.stream_options.include_usage)
        return _Call("chat", b, prompt, params, renames, logprobs, include_usage, tools)

    def _completion_call(self, b: CompletionRequest) -> _Call:
        if b.suffix:
            raise _invalid("suffix", "suffix is not supported by this server")
        if b.best_of is not None and b.best_of != 1:
            raise _invalid("best_of", f"best_of must be 1, got {b.best_of}")
        prompts = (
            b.prompt if isinstance(b.prompt, list) and b.prompt and isinstance(b.prompt[0], (str, list)) else [b.prompt]
        )
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise _invalid("prompt", f"prompt: a list of 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        echo = bool(b.echo)
        if b.max_tokens == 0 and not echo:
            raise _invalid("max_tokens", "max_tokens must be >= 1 (0 only with echo: the prompt alone)")
        drop = b.max_tokens == 0
        # Echo's logprobs over the prompt and vLLM's prompt_logprobs come from one scoring prefill.
        want = [n for n in (b.logprobs if echo else None, b.prompt_logprobs) if n is not None]
        renames = {"prompt_token_ids": "prompt"}
        if echo and b.logprobs is not None and b.prompt_logprobs is None:
            renames["prompt_logprobs"] = "logprobs"
        base = self._sampling(b, 1 if drop else b.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, b.logprobs, renames)
        params = base if not want else lambda n: dataclasses.replace(base(n), prompt_logprobs=max(want))
        try:
            params(0)
        except ValueError as e:
            raise self._engine_error(e, renames) from None
        include_usage = bool(b.stream and b.stream_options and b.stream_options.include_usage)
        call = _Call("completion", b, prompts[0], params, renames, b.logprobs, include_usage)
        call.prompts, call.echo, call.drop_output, call.prompt_logprobs = prompts, echo, drop, b.prompt_logprobs
        return call

    # -- serving ----------------------------------------------------------------------
    async def _submit(self, call: _Call, prompt, request_id: str) -> RequestStream:
        """Submit one prompt of the call; the engine's refusal as an OpenAI error."""
        try:
            return await self.engine.submit(prompt, call.params, request_id)
        except ValueError as e:
            err = self._engine_error(e, call.renames)
            if (
                "exceeds max_model_len" in str(e)
                and call.body.max_tokens is None
                and not getattr(call.body, "max_completion_tokens", None)
            ):
                err.param = "messages" if call.kind == "chat" else "prompt"  # the prompt alone is too long
                err.code = "context_length_exceeded"
            raise err from None
        except QueueFull as e:
            raise APIError(429, str(e), code="rate_limit_exceeded") from None
        except EngineDead as e:
            raise APIError(503, str(e), type_="service_unavailable") from None

    # -- /v1/chat/completions -------------------------------------------------------------
    async def _serve_chat(self, call: _Call, request: Request):
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="service_unavailable")
        call.id = f"chatcmpl-{uuid.uuid4().hex}"
        call.created = int(time.time())
        stream = await self._submit(call, call.prompt, call.id)
        if call.body.stream:
            return EventSourceResponse(self._events(call, stream), ping=15, sep="\n")
        return await self._until_done_or_gone(self._collect(call, stream), request)

    async def _until_done_or_gone(self, coro, request: Request):
        """Await the response unless the client disconnects first: then cancel it (which
        aborts the request: its slot and pages are free within one engine step)."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # its cleanup aborts the request
        if task.cancelled():
            return JSONResponse({}, status_code=499)  # nobody reads it
        return task.result()

    def _outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The engine's outputs through the shared request lifecycle (metrics; an abort if the
        consumer stops early)."""
        return RequestLife(self.engine, self.metrics, stream).outputs()

    async def _collect(self, call: _Call, stream: RequestStream) -> JSONResponse:
        n = stream.n  # choices, by the outputs' index
        text, lps, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        n_ids = 0
        try:
            async with contextlib.aclosing(self._outputs(stream)) as outputs:
                async for out in outputs:
                    text[out.index].append(out.text)
                    n_ids += len(out.token_ids)
                    lps[out.index] += out.logprobs or []
                    last[out.index] = out
        except Exception as e:
            log.exception("engine error")
            return APIError(500, f"engine error: {e}").response()
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {"index": i, "finish_reason": last[i].finish_reason}
            logprobs = await self._logprobs(call, lps[i]) if call.logprobs is not None else None
            choice["message"] = {"role": "assistant", "content": "".join(text[i])}
            parser = self.tool_calling.parser(call.tools)
            if parser is not None:
                choice["message"] = parser.message("".join(text[i]))
                choice["finish_reason"] = finish_reason(parser, choice["finish_reason"])
            choice["logprobs"] = logprobs
            choices.append(choice)
        return JSONResponse(
            {
                **self._head(call, "chat.completion"),
                "choices": choices,
                "usage": _usage(len(stream.prompt_token_ids), n_ids, last[0].num_cached_prompt_tokens),
            }
        )

    def _head(self, call: _Call, obj: str) -> dict:
        return {"id": call.id, "object": obj, "created": call.created, "model": self.model_name}

    async def _events(self, call: _Call, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks (the first of each choice carries the role), the
        usage chunk if asked for, then [DONE]."""
        head = self._head(call, "chat.completion.chunk")
        extra = {"usage": None} if call.include_usage else {}
        dumps = json.dumps
        for i in range(stream.n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield dumps({**head, "choices": [first], **extra})
        n_out, last = 0, None
        parsers = [self.tool_calling.parser(call.tools) for _ in range(stream.n)]
        try:
            async with contextlib.aclosing(self._outputs(stream)) as outputs:
                async for out in outputs:
                    n_out += len(out.token_ids)
                    last = out
                    if not (out.token_ids or out.text or out.finished):
                        continue  # one chunk per engine output, like gRPC (text may be held back)
                    choice: dict[str, Any] = {"index": out.index}
                    parser = parsers[out.index]
                    if parser is not None:
                        choice["delta"] = parser.delta(out.text, out.finished)
                    else:
                        choice["delta"] = {"content": out.text} if out.text else {}
                    lp = await self._logprobs(call, out.logprobs) if call.logprobs is not None else None
                    choice["logprobs"] = lp
                    choice["finish_reason"] = finish_reason(parser, out.finish_reason)
                    yield dumps({**head, "choices": [choice], **extra})
        except Exception as e:
            log.exception("engine error")
            yield dumps(APIError(500, f"engine error: {e}").body())
            yield "[DONE]"
            return
        if call.include_usage:
            usage = _usage(len(stream.prompt_token_ids), n_out, last.num_cached_prompt_tokens)
            yield dumps({**head, "choices": [], "usage": usage})
        yield "[DONE]"

    # -- /v1/completions ----------------------------------------------------------------
    async def _serve_completion(self, call: _Call, request: Request):
        """Each prompt of the list is its own engine request; the choices of prompt p are
        p * n + 0..n-1. A refused prompt aborts the ones already submitted."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="service_unavailable")
        call.id, call.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = await self._echo_texts(call)  # before submitting: a refusal leaves nothing in flight
        streams: list[RequestStream] = []
        try:
            for p, prompt in enumerate(call.prompts):
                streams.append(await self._submit(call, prompt, call.id if p == 0 else f"{call.id}-{p}"))
        except BaseException:
            for st in streams:
                self.engine.abort(st.request_id)
            raise
        if call.body.stream:
            return EventSourceResponse(self._completion_events(call, streams, echo), ping=15, sep="\n")
        return await self._until_done_or_gone(self._completion_collect(call, streams, echo), request)

    async def _echo_texts(self, call: _Call) -> list[str]:
        """Each prompt's echo: its text as given, or its token ids decoded (the engine keeps
        token-id prompts as given). A 400 when they cannot be decoded (no tokenizer, an id
        outside the vocabulary); called before any prompt is submitted."""
        if not call.echo:
            return [""] * len(call.prompts)
        loop = asyncio.get_running_loop()
        out = []
        for prompt in call.prompts:
            if isinstance(prompt, str):
                out.append(prompt)
                continue
            if not self.engine.has_tokenizer:
                raise _invalid(
                    "echo",
                    f"echo: {self.model_name} has no tokenizer to decode a token-id prompt with; send the request"
                    " without echo",
                )
            try:
                out.append(await loop.run_in_executor(None, self.engine.detokenize, prompt))
            except ValueError as e:
                raise _invalid("prompt", str(e).removeprefix("tokens: ")) from None
        return out

    async def _merged(self, call: _Call, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every stream as they come; closing it aborts the rest."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, stream: RequestStream) -> None:
            try:
                async with contextlib.aclosing(self._outputs(stream)) as outputs:
                    async for out in outputs:
                        q.put_nowait((p, out))
            except Exception as e:
                q.put_nowait((p, e))
            finally:
                q.put_nowait((p, None))

        tasks = [asyncio.create_task(pump(p, st)) for p, st in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                p, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their cleanup aborts unfinished requests

    def _choice_index(self, streams: list[RequestStream], p: int, out: RequestOutput) -> int:
        return p * streams[0].n + out.index

    def _absorb(self, call: _Call, choice: _CompletionChoice, out: RequestOutput) -> tuple[str, list, list]:
        """An engine output's share of a choice: (text, output logprobs, echoed prompt part),
        the echoed prompt in the choice's first output only."""
        text, lps = ("", []) if call.drop_output else (out.text, out.logprobs or [])
        prompt_part: list = []
        if out.prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs, choice.prompt_ranks = out.prompt_logprobs, out.prompt_ranks
        if call.echo and not choice.echoed:
            choice.echoed = True
            prompt_part = [
                (t, (choice.prompt_logprobs or [None] * len(out.prompt_token_ids))[i])
                for i, t in enumerate(out.prompt_token_ids)
            ]
        choice.finish_reason = out.finish_reason
        return text, lps, prompt_part

    async def _completion_collect(self, call: _Call, streams: list[RequestStream], echo: list[str]) -> JSONResponse:
        n = streams[0].n
        choices = [_CompletionChoice(i // n) for i in range(len(streams) * n)]
        parts: list[list] = [[] for _ in choices]  # echoed prompt (token, logprobs) pairs
        last: dict[int, RequestOutput] = {}
        n_out = 0
        try:
            async with contextlib.aclosing(self._merged(call, streams)) as merged:
                async for p, out in merged:
                    i = self._choice_index(streams, p, out)
                    text, lps, prompt_part = self._absorb(call, choices[i], out)
                    choices[i].text.append(text)
                    choices[i].logprobs += lps
                    parts[i] += prompt_part
                    n_out += 0 if call.drop_output else len(out.token_ids)
                    last[p] = out
        except Exception as e:
            log.exception("engine error")
            return APIError(500, f"engine error: {e}").response()
        body = []
        for i, c in enumerate(choices):
            text = (echo[c.prompt] if call.echo else "") + "".join(c.text)
            entry: dict[str, Any] = {"index": i, "text": text}
            entry["logprobs"] = (
                await self._completion_logprobs(call, parts[i], c.logprobs, 0) if call.logprobs is not None else None
            )
            entry["finish_reason"] = c.finish_reason
            if call.prompt_logprobs is not None:
                entry["prompt_logprobs"] = await self._vllm_prompt_logprobs(call, c)
            body.append(entry)
        n_prompt = sum(len(st.prompt_token_ids) for st in streams)
        cached = sum(out.num_cached_prompt_tokens for out in last.values())
        return JSONResponse(
            {**self._head(call, "text_completion"), "choices": body, "usage": _usage(n_prompt, n_out, cached)}
        )

    async def _completion_events(
        self, call: _Call, streams: list[RequestStream], echo: list[str]
    ) -> AsyncIterator[str]:
        head = self._head(call, "text_completion")
        extra = {"usage": None} if call.include_usage else {}
        n = streams[0].n
        choices = [_CompletionChoice(i // n) for i in range(len(streams) * n)]
        n_out, last = 0, {}
        try:
            async with contextlib.aclosing(self._merged(call, streams)) as merged:
                async for p, out in merged:
                    i = self._choice_index(streams, p, out)
                    c = choices[i]
                    first = not c.echoed
                    text, lps, prompt_part = self._absorb(call, c, out)
                    if call.echo and first:
                        text = echo[p] + text
                    n_out += 0 if call.drop_output else len(out.token_ids)
                    last[p] = out
                    if not (text or lps or prompt_part or out.finished):
                        continue  # one chunk per engine output (text may be held back)
                    choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None}
                    if call.logprobs is not None:
                        choice["logprobs"] = await self._completion_logprobs(call, prompt_part, lps, c.offset)
                        offsets = choice["logprobs"]["text_offset"]
                        toks = choice["logprobs"]["tokens"]
                        c.offset = offsets[-1] + len(toks[-1]) if toks else c.offset
                    choice["finish_reason"] = out.finish_reason
                    if call.prompt_logprobs is not None and first:
                        choice["prompt_logprobs"] = await self._vllm_prompt_logprobs(call, c)
                    yield json.dumps({**head, "choices": [choice], **extra})
        except Exception as e:
            log.exception("engine error")
            yield json.dumps(APIError(500, f"engine error: {e}").body())
            yield "[DONE]"
            return
        if call.include_usage:
            n_prompt = sum(len(st.prompt_token_ids) for st in streams)
            usage = _usage(n_prompt, n_out, sum(o.num_cached_prompt_tokens for o in last.values()))
            yield json.dumps({**head, "choices": [], "usage": usage})
        yield "[DONE]"

    async def _token_names(self, call: _Call, ids: set[int]) -> Callable[[int], str]:
        if call.body.return_tokens_as_token_ids:
            return lambda t: f"token_id:{t}"
        return (await self._texts(ids)).__getitem__

    async def _completion_logprobs(self, call: _Call, prompt_part: list, lps: list, offset: int) -> dict:
        """OpenAI's legacy completions logprobs over the echoed prompt tokens (the first one's
        null: nothing predicts it) and the generated ones: tokens, token_logprobs, top_logprobs
        and text_offset (into the text). Each position's top_logprobs are up to logprobs + 1
        entries, as OpenAI documents and vLLM does: the `logprobs` most likely (split_logprobs'
        order), then the position's own token (sampled or prompt) when not among them, so
        logprobs=0 gives just that token. Chat's top_logprobs stay the n most likely."""
        n = call.logprobs
        rows: list[tuple[int, float | None, list[TokenLogprob] | None]] = []
        for tid, lp in prompt_part:
            if lp is None:
                rows.append((tid, None, None))
            else:
                chosen, top = split_logprobs(lp, n)
                rows.append((tid, chosen.logprob, top))
        for lp in lps:
            chosen, top = split_logprobs(lp, n)
            rows.append((chosen.token_id, chosen.logprob, top))
        name = await self._token_names(call, {t for t, _, top in rows for t in (t, *(x.token_id for x in top or ()))})
        tokens = [name(t) for t, _, _ in rows]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        tops: list[dict[str, float] | None] = []
        for tok, (_, value, top) in zip(tokens, rows):
            if top is None:
                tops.append(None)
                continue
            d = {name(x.token_id): x.logprob for x in top}
            d[tok] = value  # appended when outside the top n (it ranks last); its own value either way
            tops.append(d)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    async def _vllm_prompt_logprobs(self, call: _Call, c: _CompletionChoice) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}}, the prompt token (its rank in the vocabulary) and the top n."""
        if c.prompt_logprobs is None:
            return None
        n = call.prompt_logprobs
        steps = [None if lp is None else split_logprobs(lp, n) for lp in c.prompt_logprobs]
        name = await self._token_names(call, {t.token_id for s in steps if s is not None for t in (s[0], *s[1])})
        out = []
        for s, rank in zip(steps, c.prompt_ranks):
            if s is None:
                out.append(None)
                continue
            chosen, top = s
            d = {
                str(chosen.token_id): {"logprob": chosen.logprob, "rank": rank, "decoded_token": name(chosen.token_id)}
            }
            for r, t in enumerate(top, 1):
                d.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": r, "decoded_token": name(t.token_id)})
            out.append(d)
        return out

    # -- /tokenize --------------------------------------------------------------------
    async def _tokenize(self, b: TokenizeRequest) -> dict:
        if b.model is not None:
            self._check_model(b.model)
        if (b.prompt is None) == (b.messages is None):
            raise _invalid("prompt", "prompt: give exactly one of prompt and messages")
        loop = asyncio.get_running_loop()
        try:
            if b.messages is not None:
                prompt: Any = Conversation.of(b.messages)
                add = bool(b.add_special_tokens)
            else:
                prompt, add = b.prompt, b.add_special_tokens is not False
            ids = await loop.run_in_executor(None, self.engine.tokenize, prompt, add)
        except ValueError as e:
            raise self._engine_error(e, {}) from None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    # -- logprobs ---------------------------------------------------------------------
    async def _texts(self, ids: set[int]) -> dict[int, str]:
        """Each token's own text (cached); decoding runs in a worker thread, off the event loop."""
        missing = [t for t in ids if t not in self._token_texts]
        if missing:
            texts = await asyncio.get_running_loop().run_in_executor(None, self.engine.token_texts, missing)
            self._token_texts.update(texts)
        return self._token_texts

    async def _logprobs(self, call: _Call, lps: list[dict[int, float]] | None) -> dict | None:
        """A chat choice's logprobs (`content`: each token with its top_logprobs)."""
        if not lps:
            return {"content": []}
        # OpenAI's top_logprobs are the n most likely tokens at each position, the chosen one
        # included when it is among them: split_logprobs, the conversion gRPC uses too (ties too).
        steps = [split_logprobs(lp, call.logprobs) for lp in lps]
        name = await self._token_names(call, {t.token_id for c, top in steps for t in (c, *top)})

        def entry(t):
            s = name(t.token_id)
            return {"token": s, "logprob": t.logprob, "bytes": list(s.encode())}

        return {"content": [{**entry(c), "top_logprobs": [entry(t) for t in top]} for c, top in steps]}


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Uvicorn(uvicorn.Server):
    """uvicorn in the caller's event loop: signals are the caller's (Server drains on SIGTERM)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def _ssl_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """The gRPC server's certificate and key, for HTTPS (ssl loads them from files only)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cert.pem").write_bytes(cert)
        key_path = Path(d) / "key.pem"
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        ctx.load_cert_chain(Path(d) / "cert.pem", key_path)
    return ctx
