"""The OpenAI-compatible HTTP frontend: GET /v1/models, POST /v1/completions, POST
/v1/chat/completions (streamed as server-sent events ending in `data: [DONE]`, or not), GET
/health, vLLM's POST /tokenize and /detokenize, and GET /metrics (Prometheus: jaxserve's and
vLLM's names, metrics.py).

/v1/completions serves evaluation harnesses (lm-eval's `local-completions`) as vLLM does:
prompt lists (each prompt its own choices, index = prompt * n + completion), token-id
prompts, `echo` (max_tokens 0 allowed) with `logprobs` over the echoed prompt tokens (the
first one's null) and vLLM's `prompt_logprobs`; the engine scores the prompt in its prefill.

The endpoints live by module: chat_endpoint.py (/v1/chat/completions), completions_endpoint.py
(/v1/completions), routing.py (what routers call: /live, /get_load, render); the request bodies,
errors and the request-to-SamplingParams mapping in protocol.py. This module is the app: routes,
auth, the model card, submitting and aborting, /tokenize, and the uvicorn server.

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
import logging
import socket
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxserve.engine.chat import Conversation
from jaxserve.engine.client import EngineClient, EngineDead, QueueFull, RequestStream, split_logprobs
from jaxserve.engine.request import RequestOutput, SamplingParams
from jaxserve.engine.tool_calls import ToolCalling
from jaxserve.serving import routing
from jaxserve.serving.chat_endpoint import ChatEndpoint
from jaxserve.serving.completions_endpoint import CompletionsEndpoint
from jaxserve.serving.lifecycle import RequestLife
from jaxserve.serving.metrics import Metrics
from jaxserve.serving.protocol import (
    APIError,
    Call,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    disconnected,
    engine_error,
    invalid,
    to_sampling_params,
    validation_param,
)

log = logging.getLogger("jaxserve.http")


# -- the frontend -----------------------------------------------------------------------
class HttpFrontend(ChatEndpoint, CompletionsEndpoint):
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
            param = validation_param(tuple(err.get("loc", ())))
            if err.get("type") == "json_invalid":
                param = None
            msg = err.get("msg", "invalid request body")
            return invalid(param, msg).response() if param else APIError(400, msg).response()

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
                raise engine_error(e, {}) from None
            return {"prompt": text}

        @app.get("/tokenizer_info", dependencies=auth)
        async def tokenizer_info():
            try:
                return self.engine.tokenizer_info()
            except ValueError as e:
                raise engine_error(e, {}) from None

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        # the routers' endpoints: /live, /get_load, /v1/completions/render, /v1/chat/completions/render
        routing.add_routes(app, self)
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
        self, b, max_tokens: int | None, default_max: int, logprobs: int | None, renames: dict, grammar=None
    ) -> Callable[[int], SamplingParams]:
        """The request's SamplingParams builder (protocol.to_sampling_params) at this model's length."""
        return to_sampling_params(b, max_tokens, default_max, self.max_model_len, logprobs, renames, grammar)

    @property
    def tool_calling(self) -> ToolCalling:
        """The checkpoint's tool-call family and template support (tool_calls.py), built on first use."""
        if self._tool_calling is None:
            core = self.engine.core
            self._tool_calling = ToolCalling.for_tokenizer(core.tokenizer, core.cfg.tool_call_parser)
        return self._tool_calling

    # -- serving ----------------------------------------------------------------------
    async def _submit(self, call: Call, prompt, request_id: str) -> RequestStream:
        """Submit one prompt of the call; the engine's refusal as an OpenAI error."""
        try:
            return await self.engine.submit(prompt, call.params, request_id)
        except ValueError as e:
            err = engine_error(e, call.renames)
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

    async def _until_done_or_gone(self, coro, request: Request):
        """Await the response unless the client disconnects first: then cancel it (which
        aborts the request: its slot and pages are free within one engine step)."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(disconnected(request))
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

    def _head(self, call: Call, obj: str) -> dict:
        return {"id": call.id, "object": obj, "created": call.created, "model": self.model_name}

    # -- /v1/completions ----------------------------------------------------------------

    # -- /tokenize --------------------------------------------------------------------
    async def _tokenize(self, b: TokenizeRequest) -> dict:
        if b.model is not None:
            self._check_model(b.model)
        if (b.prompt is None) == (b.messages is None):
            raise invalid("prompt", "prompt: give exactly one of prompt and messages")
        loop = asyncio.get_running_loop()
        try:
            if b.messages is not None:
                prompt: Any = Conversation.of(b.messages)
                add = bool(b.add_special_tokens)
            else:
                prompt, add = b.prompt, b.add_special_tokens is not False
            ids = await loop.run_in_executor(None, self.engine.tokenize, prompt, add)
        except ValueError as e:
            raise engine_error(e, {}) from None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    # -- logprobs ---------------------------------------------------------------------
    async def _texts(self, ids: set[int]) -> dict[int, str]:
        """Each token's own text (cached); decoding runs in a worker thread, off the event loop."""
        missing = [t for t in ids if t not in self._token_texts]
        if missing:
            texts = await asyncio.get_running_loop().run_in_executor(None, self.engine.token_texts, missing)
            self._token_texts.update(texts)
        return self._token_texts

    async def _logprobs(self, call: Call, lps: list[dict[int, float]] | None) -> dict | None:
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
