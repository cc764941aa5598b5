"""The gRPC frontend (grpc.aio): streaming Generate, Abort, GetModelInfo, health, reflection,
Prometheus metrics, bearer-token auth, optional TLS, and a draining SIGTERM.

The engine runs in one thread (EngineLoop) that calls LLM.step() and hands each request's
incremental outputs to the asyncio queue of the RPC that owns it. RPC handlers never touch
arrays: they validate, submit, stream and, when the client goes away, abort.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.llm import LLM
from jaxserve.metrics import Metrics
from jaxserve.request import RequestOutput, SamplingParams, Sequence
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
FINISH = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}


class QueueFull(Exception):
    pass


class EngineLoop:
    """Owns the LLM: one thread steps it, queues carry outputs back to the RPCs."""

    def __init__(self, llm: LLM, metrics: Metrics, max_waiting: int = 256):
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._routes)

    def submit(self, seq: Sequence, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if seq.request_id in self._routes:
                raise ValueError(f"request_id: {seq.request_id!r} is already in use")
            if len(self._routes) - len(self.llm.scheduler.running) >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._routes[seq.request_id] = (loop, q)
        self.llm.submit(seq)
        self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = request_id in self._routes
        if found:
            self.llm.abort(request_id)
            self._wake.set()
        return found

    def _deliver(self, out: RequestOutput | BaseException, request_id: str, last: bool) -> None:
        with self._lock:
            route = self._routes.pop(request_id, None) if last else self._routes.get(request_id)
        if route is not None:
            loop, q = route
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _run(self) -> None:
        while not self._stop:
            if not self.llm.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:  # keep serving: fail what was in flight, not the process
                log.exception("engine step failed")
                for rid in self.in_flight:
                    self.llm.abort(rid)
                    self._deliver(e, rid, last=True)
                continue
            for out in outputs:
                self._deliver(out, out.request_id, last=out.finished)
            self.metrics.update_engine(self.llm.stats())


class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, engine: EngineLoop, default_max_tokens: int = 256):
        self.engine = engine
        self.llm = engine.llm
        self.metrics = engine.metrics
        self.default_max_tokens = default_max_tokens
        self.draining = False

    def _sequence(self, req: pb.GenerateRequest) -> Sequence:
        which = req.WhichOneof("prompt")
        if which is None:
            raise ValueError("prompt: one of text or token_ids is required")
        prompt: Any = req.text if which == "text" else list(req.token_ids.ids)
        s = req.sampling
        n_prompt = len(prompt) if which == "token_ids" else None
        max_tokens = s.max_tokens
        if max_tokens == 0:
            room = self.llm.max_model_len - (n_prompt if n_prompt is not None else len(self._tokenize(prompt)))
            max_tokens = max(1, min(self.default_max_tokens, room))
        if s.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {s.logprobs}")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k,
            top_p=s.top_p if s.top_p != 0 else 1.0, seed=s.seed if s.HasField("seed") else None,
            stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
            logprobs=s.logprobs or None)
        return self.llm.make_sequence(prompt, params, req.request_id or uuid.uuid4().hex)

    def _tokenize(self, text: str) -> list[int]:
        if self.llm.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token_ids instead of text")
        return self.llm.tokenizer.encode(text, add_special_tokens=True)

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        try:
            seq = self._sequence(request)
            queue = self.engine.submit(seq, asyncio.get_running_loop())
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            self.metrics.requests.labels("rejected").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        rid = seq.request_id
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        start = last = time.perf_counter()
        first_at, completion, done = None, 0, False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    self.metrics.requests.labels("error").inc()
                    await context.abort(grpc.StatusCode.INTERNAL, f"engine error: {out}")
                now = time.perf_counter()
                if out.token_ids:
                    if first_at is None:
                        first_at = now
                        self.metrics.ttft.observe(now - start)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                completion += len(out.token_ids)
                self.metrics.generation_tokens.inc(len(out.token_ids))
                resp = pb.GenerateResponse(request_id=rid, text=out.text, token_ids=out.token_ids)
                for lp in out.logprobs or []:
                    items = list(lp.items())
                    chosen, rest = items[0], sorted(items[1:], key=lambda kv: -kv[1])
                    resp.logprobs.add(token_id=chosen[0], logprob=chosen[1],
                                      top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in rest])
                if out.finished:
                    done = True
                    resp.finish_reason = FINISH[out.finish_reason]
                    resp.usage.CopyFrom(pb.Usage(prompt_tokens=len(seq.prompt_ids), completion_tokens=completion,
                                                 cached_prompt_tokens=out.num_cached_prompt_tokens))
                    self.metrics.requests.labels(out.finish_reason).inc()
                    if first_at is not None and completion > 1:
                        self.metrics.tpot.observe((now - first_at) / (completion - 1))
                yield resp
                if done:
                    return
        finally:
            if not done:  # the client cancelled or its deadline passed: free the slot and pages now
                self.metrics.requests.labels("cancelled").inc()
                self.engine.abort(rid)

    async def Abort(self, request, context):
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        llm = self.llm
        features = [f"attention:{llm.engine.attention_impl}"]
        if llm.prefix_cache is not None:
            features.append("prefix_caching")
        spec = getattr(llm, "speculative_name", None)
        if spec:
            features.append(f"speculative:{spec}")
        return pb.ModelInfo(model_name=llm.model_path.name, context_length=llm.max_model_len,
                            vocab_size=llm.model_cfg.vocab_size, features=features, max_slots=llm.cfg.max_slots,
                            page_size=llm.cfg.page_size, num_kv_pages=llm.allocator.capacity,
                            has_tokenizer=llm.tokenizer is not None)


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

    def __init__(self, llm: LLM, host: str = "127.0.0.1", port: int = 50051, metrics_port: int | None = None,
                 token: str | None = None, tls_cert: bytes | None = None, tls_key: bytes | None = None,
                 max_waiting: int = 256, default_max_tokens: int = 256, grace_s: float = 30.0):
        self.metrics = Metrics()
        self.engine = EngineLoop(llm, self.metrics, max_waiting)
        self.servicer = JaxServeServicer(self.engine, default_max_tokens)
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.token, self.tls = token, (tls_cert, tls_key) if tls_cert else None
        self.grace_s = grace_s
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None

    async def start(self) -> int:
        interceptors = [BearerAuth(self.token)] if self.token else []
        server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_JaxServeServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
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
    await stopping.wait()
    log.info("signal received: draining")
    await server.drain()


def serve(llm: LLM, **kwargs) -> None:
    asyncio.run(_serve_forever(Server(llm, **kwargs)))
