"""The OpenAI-compatible HTTP frontend: GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (streamed as server-sent events ending in `data: [DONE]`, or not), GET
/health.

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
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sse_starlette import EventSourceResponse

from jaxserve.engine.chat import Conversation
from jaxserve.engine.client import EngineClient, EngineDead, QueueFull, RequestStream, split_logprobs
from jaxserve.engine.request import RequestOutput, SamplingParams
from jaxserve.engine.tool_calls import ToolCalling, ToolRequest, finish_reason
from jaxserve.serving.metrics import Metrics

log = logging.getLogger("jaxserve.http")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
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
        config = uvicorn.Config(
            self.app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=5
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
            return await self._serve(self._chat_call(body), request)

        @app.post("/v1/completions", dependencies=auth)
        async def completions(body: CompletionRequest, request: Request):
            self._check_model(body.model)
            return await self._serve(self._completion_call(body), request)

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
            n = max_tokens if max_tokens is not None else max(1, min(default_max, self.max_model_len - prompt_len))
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
        for name in ("echo", "suffix"):
            if getattr(b, name):
                raise _invalid(name, f"{name} is not supported by this server")
        if b.best_of is not None and b.best_of != 1:
            raise _invalid("best_of", f"best_of must be 1, got {b.best_of}")
        prompt = b.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _invalid("prompt", f"one prompt per request is supported, got a batch of {len(prompt)}")
            prompt = prompt[0]
        renames = {"prompt_token_ids": "prompt"}
        params = self._sampling(b, b.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, b.logprobs, renames)
        include_usage = bool(b.stream and b.stream_options and b.stream_options.include_usage)
        return _Call("completion", b, prompt, params, renames, b.logprobs, include_usage)

    # -- serving ----------------------------------------------------------------------
    async def _serve(self, call: _Call, request: Request):
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="service_unavailable")
        call.id = f"{'chatcmpl' if call.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        call.created = int(time.time())
        try:
            stream = await self.engine.submit(call.prompt, call.params, call.id)
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

    async def _outputs(self, call: _Call, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The engine's outputs, with metrics; aborts the request if the consumer stops early."""
        timer = self.metrics.request(len(stream.prompt_token_ids))
        done = False
        try:
            async for out in stream:
                timer.tokens(len(out.token_ids))
                if out.finished and stream.finished:  # the last of the request's n choices
                    done = True
                    timer.finish(out.finish_reason)
                yield out
        except Exception:
            done = True
            timer.finish("error")
            raise
        finally:
            if not done:  # the client went away: free the slot and pages now
                timer.finish("cancelled")
                self.engine.abort(stream.request_id)

    async def _collect(self, call: _Call, stream: RequestStream) -> JSONResponse:
        n = stream.n  # choices, by the outputs' index
        text, lps, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        n_ids = 0
        try:
            async with contextlib.aclosing(self._outputs(call, stream)) as outputs:
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
            if call.kind == "chat":
                choice["message"] = {"role": "assistant", "content": "".join(text[i])}
                parser = self.tool_calling.parser(call.tools)
                if parser is not None:
                    choice["message"] = parser.message("".join(text[i]))
                    choice["finish_reason"] = finish_reason(parser, choice["finish_reason"])
            else:
                choice["text"] = "".join(text[i])
            choice["logprobs"] = logprobs
            choices.append(choice)
        return JSONResponse(
            {
                **self._head(call, "chat.completion" if call.kind == "chat" else "text_completion"),
                "choices": choices,
                "usage": _usage(len(stream.prompt_token_ids), n_ids, last[0].num_cached_prompt_tokens),
            }
        )

    def _head(self, call: _Call, obj: str) -> dict:
        return {"id": call.id, "object": obj, "created": call.created, "model": self.model_name}

    async def _events(self, call: _Call, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks, the usage chunk if asked for, then [DONE]."""
        chat = call.kind == "chat"
        head = self._head(call, "chat.completion.chunk" if chat else "text_completion")
        extra = {"usage": None} if call.include_usage else {}
        dumps = json.dumps
        if chat:
            for i in range(stream.n):
                first = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield dumps({**head, "choices": [first], **extra})
        n_out, last = 0, None
        parsers = [self.tool_calling.parser(call.tools) if chat else None for _ in range(stream.n)]
        try:
            async with contextlib.aclosing(self._outputs(call, stream)) as outputs:
                async for out in outputs:
                    n_out += len(out.token_ids)
                    last = out
                    if not (out.token_ids or out.text or out.finished):
                        continue  # one chunk per engine output, like gRPC (text may be held back)
                    choice: dict[str, Any] = {"index": out.index}
                    parser = parsers[out.index] if chat else None
                    if parser is not None:
                        choice["delta"] = parser.delta(out.text, out.finished)
                    elif chat:
                        choice["delta"] = {"content": out.text} if out.text else {}
                    else:
                        choice["text"] = out.text
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

    # -- logprobs ---------------------------------------------------------------------
    async def _texts(self, ids: set[int]) -> dict[int, str]:
        """Each token's own text (cached); decoding runs in a worker thread, off the event loop."""
        missing = [t for t in ids if t not in self._token_texts]
        if missing:
            texts = await asyncio.get_running_loop().run_in_executor(None, self.engine.token_texts, missing)
            self._token_texts.update(texts)
        return self._token_texts

    async def _logprobs(self, call: _Call, lps: list[dict[int, float]] | None) -> dict | None:
        if not lps:
            return {"content": []} if call.kind == "chat" else {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        # OpenAI's top_logprobs are the n most likely tokens at each position, the chosen one
        # included when it is among them: split_logprobs, the conversion gRPC uses too (ties too).
        steps = [split_logprobs(lp, call.logprobs) for lp in lps]
        if call.body.return_tokens_as_token_ids:
            name = lambda t: f"token_id:{t}"  # noqa: E731
        else:
            texts = await self._texts({t.token_id for c, top in steps for t in (c, *top)})
            name = texts.__getitem__
        if call.kind == "chat":

            def entry(t):
                s = name(t.token_id)
                return {"token": s, "logprob": t.logprob, "bytes": list(s.encode())}

            return {"content": [{**entry(c), "top_logprobs": [entry(t) for t in top]} for c, top in steps]}
        return {
            "tokens": [name(c.token_id) for c, _ in steps],
            "token_logprobs": [c.logprob for c, _ in steps],
            "top_logprobs": [{name(t.token_id): t.logprob for t in top} for _, top in steps],
        }


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
