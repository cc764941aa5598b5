"""The gRPC frontend (grpc.aio): streaming Generate, Abort, GetModelInfo, health, reflection,
Prometheus metrics, bearer-token auth, optional TLS, and a draining SIGTERM.

The engine runs in one thread behind an EngineClient, which hands each request's
incremental outputs to the asyncio queue of the RPC that owns it. RPC handlers never touch
arrays or the scheduler: they submit (validation and tokenization run in a worker thread),
stream and, when the client goes away, abort.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.chat import Conversation
from jaxserve.engine.client import EngineClient, QueueFull, split_logprobs
from jaxserve.engine.request import SamplingParams
from jaxserve.serving.metrics import Metrics
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
FINISH = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}


class JaxServeServicer(pb_grpc.JaxServeServicer):
    """gRPC requests in, engine-client calls out: validation and outputs are the engine's."""

    def __init__(self, engine: EngineClient, metrics: Metrics, default_max_tokens: int = 256):
        self.engine = engine
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.max_model_len = engine.model_info().context_length
        self.draining = False

    def _params(self, req: pb.GenerateRequest):
        """The request's SamplingParams, as a function of its prompt length when max_tokens
        is unset (then: the default, or what fits in the context)."""
        s = req.sampling
        if s.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {s.logprobs}")
        which = s.WhichOneof("constraint")
        constraint = {which: getattr(s, which)} if which else {}

        def build(prompt_len: int) -> SamplingParams:
            max_tokens = s.max_tokens or max(1, min(self.default_max_tokens, self.max_model_len - prompt_len))
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p if s.top_p != 0 else 1.0,
                seed=s.seed if s.HasField("seed") else None,
                stop=tuple(s.stop),
                stop_token_ids=tuple(s.stop_token_ids),
                ignore_eos=s.ignore_eos,
                logprobs=s.logprobs or None,
                **constraint,
                n=s.n or 1,
                min_p=s.min_p,
                min_tokens=s.min_tokens,
                repetition_penalty=s.repetition_penalty or 1.0,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                logit_bias=dict(s.logit_bias) or None,
            )

        return build

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        which = request.WhichOneof("prompt")
        try:
            if which is None:
                raise ValueError("prompt: one of text, token_ids or messages is required")
            if which == "messages":  # rendered by the chat template in the engine client's worker thread
                prompt: Any = Conversation.of(
                    [{"role": m.role, "content": m.content} for m in request.messages.messages]
                )
            else:
                prompt = request.text if which == "text" else list(request.token_ids.ids)
            stream = await self.engine.submit(prompt, self._params(request), request.request_id or uuid.uuid4().hex)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            self.metrics.requests.labels("rejected").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        rid = stream.request_id
        n_prompt = len(stream.prompt_token_ids)
        timer = self.metrics.request(n_prompt)
        done = False
        try:
            try:
                async for out in stream:
                    timer.tokens(len(out.token_ids))
                    resp = pb.GenerateResponse(request_id=rid, text=out.text, token_ids=out.token_ids, index=out.index)
                    for lp in out.logprobs or []:
                        chosen, top = split_logprobs(lp, request.sampling.logprobs)
                        resp.logprobs.add(
                            token_id=chosen.token_id,
                            logprob=chosen.logprob,
                            top=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in top],
                        )
                    if out.finished:  # this completion; the request when all n are (stream.finished)
                        done = stream.finished
                        resp.finish_reason = FINISH[out.finish_reason]
                        resp.usage.CopyFrom(
                            pb.Usage(
                                prompt_tokens=n_prompt,
                                completion_tokens=timer.completion,
                                cached_prompt_tokens=out.num_cached_prompt_tokens,
                            )
                        )
                        if done:
                            timer.finish(out.finish_reason)
                    yield resp
            except Exception as e:  # the engine step failed
                done = True
                timer.finish("error")
                await context.abort(grpc.StatusCode.INTERNAL, f"engine error: {e}")
        finally:
            if not done:  # the client cancelled or its deadline passed: free the slot and pages now
                timer.finish("cancelled")
                self.engine.abort(rid)

    async def Abort(self, request, context):
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        info = self.engine.model_info()
        return pb.ModelInfo(
            model_name=info.model_name,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            features=list(info.features),
            max_slots=info.max_slots,
            page_size=info.page_size,
            num_kv_pages=info.num_kv_pages,
            has_tokenizer=info.has_tokenizer,
        )


class BearerAuth(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call except health checks."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}"

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        md = dict(details.invocation_metadata or ())
        if md.get("authorization") == self.expected:
            return await continuation(details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        handler = await continuation(details)
        if handler is not None and handler.response_streaming:

            async def deny_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
                yield  # pragma: no cover

            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


class Server:
    """A running jaxserve gRPC server: start() binds and serves; drain() is what SIGTERM does."""

    def __init__(
        self,
        engine,
        host: str = "127.0.0.1",
        port: int = 50051,
        metrics_port: int | None = None,
        token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_waiting: int = 256,
        default_max_tokens: int = 256,
        grace_s: float = 30.0,
        http_port: int | None = None,
    ):
        """engine: an EngineCore (or an LLM, whose core is used): the server runs its loop.
        http_port: also serve the OpenAI-compatible HTTP API (http_server.py) on this port, in
        the same event loop over the same engine client (0 picks a free port)."""
        core = getattr(engine, "core", engine)
        info = core.model_info()
        self.metrics = Metrics(info.model_name, info.page_size, info.num_kv_pages)
        self.engine = EngineClient(core, max_waiting, on_step=self.metrics.update_engine)
        self.servicer = JaxServeServicer(self.engine, self.metrics, default_max_tokens)
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.token, self.tls = token, (tls_cert, tls_key) if tls_cert else None
        self.grace_s = grace_s
        self.default_max_tokens = default_max_tokens
        self.http_port, self.http = http_port, None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None

    async def start(self) -> int:
        interceptors = [BearerAuth(self.token)] if self.token else []
        server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_JaxServeServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )
        addr = f"{self.host}:{self.port}"
        if self.tls:
            creds = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])
            self.port = server.add_secure_port(addr, creds)
        else:
            self.port = server.add_insecure_port(addr)
        self.engine.start()
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self._metrics_http = self.metrics.serve(self.metrics_port, self.host)
        if self.http_port is not None:
            from jaxserve.serving.http_server import HttpFrontend  # FastAPI and uvicorn only when asked for

            self.http = HttpFrontend(self.engine, self.metrics, self.token, self.default_max_tokens, self.tls)
            self.http_port = await self.http.start(self.host, self.http_port)
            log.info("OpenAI-compatible HTTP on %s:%d", self.host, self.http_port)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("jaxserve listening on %s:%d", self.host, self.port)
        return self.port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            r = self.health.set(name, status)
            if asyncio.iscoroutine(r):
                await r

    async def drain(self) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, then abort
        the rest: each of their streams ends with a final ABORT message, not a broken call."""
        self.servicer.draining = True
        if self.http is not None:
            self.http.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.grace_s
        while self.engine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in self.engine.in_flight:
            self.engine.abort(rid)
        while self.engine.in_flight and time.monotonic() < deadline + 10:
            await asyncio.sleep(0.02)
        await self.stop(grace=2.0)

    async def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace)
        if self.http is not None:
            await self.http.stop()
        self.engine.stop()
        if self._metrics_http is not None:
            self._metrics_http[0].shutdown()

    async def wait(self) -> None:
        await self._server.wait_for_termination()


async def _serve_forever(server: Server) -> None:
    await server.start()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    print(f"jaxserve: serving on {server.host}:{server.port}", flush=True)
    if server.http is not None:
        print(f"jaxserve: OpenAI-compatible HTTP on http://{server.host}:{server.http_port}/v1", flush=True)
    await stopping.wait()
    log.info("signal received: draining")
    await server.drain()


def serve(engine, **kwargs) -> None:
    asyncio.run(_serve_forever(Server(engine, **kwargs)))
