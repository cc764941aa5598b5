"""The server process: one engine client, the gRPC and OpenAI-compatible HTTP frontends over it,
health, Prometheus metrics, a draining SIGTERM and a loud death.

Both frontends run in one asyncio event loop over one `EngineClient`, so a request from either
joins the same continuous batch. Either frontend may be off (`port=None`: HTTP only, as vLLM
serves). When an engine step raises, the client fails every stream in flight; the server then
reports NOT_SERVING (gRPC health, HTTP /health 503) and `serve` returns a non-zero exit code,
so a supervisor (systemd, Kubernetes) restarts the process instead of it hanging or serving on
from device state nobody can vouch for.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.client import EngineClient
from jaxserve.engine.contract import Engine
from jaxserve.serving.grpc_server import SERVICE_NAME, BearerAuth, JaxServeServicer
from jaxserve.serving.metrics import Metrics
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

EXIT_ENGINE_FAILED = 1  # serve()'s exit code after an engine failure


class Server:
    """A running jaxserve server: start() binds and serves; drain() is what SIGTERM does;
    `failed` is set when the engine died (then the process should exit: `serve` does)."""

    def __init__(
        self,
        engine: Engine | object,
        host: str = "127.0.0.1",
        port: int | None = 50051,
        metrics_port: int | None = None,
        token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_waiting: int = 256,
        default_max_tokens: int = 256,
        grace_s: float = 30.0,
        http_port: int | None = None,
    ):
        """engine: an engine core (contract.Engine: EngineCore, or a test's FakeEngine), or an
        object holding one as `.core` (an LLM): the server runs its loop.
        port: the gRPC port (0 picks a free one; None: no gRPC). http_port: also serve the
        OpenAI-compatible HTTP API (http_server.py) on this port (0 picks a free port)."""
        if port is None and http_port is None:
            raise ValueError("port: at least one of the gRPC port and http_port must be set")
        core: Engine = getattr(engine, "core", engine)
        info = core.model_info()
        self.metrics = Metrics(info.model_name, info.page_size, info.num_kv_pages)
        self.engine = EngineClient(core, max_waiting, on_step=self.metrics.update_engine, on_fatal=self._on_fatal)
        self.servicer = JaxServeServicer(self.engine, self.metrics, default_max_tokens)
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.token, self.tls = token, (tls_cert, tls_key) if tls_cert else None
        self.grace_s = grace_s
        self.default_max_tokens = default_max_tokens
        self.http_port, self.http = http_port, None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.failed = asyncio.Event()  # set in the loop when the engine died
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None

    async def start(self) -> int | None:
        """Bind and serve; returns the gRPC port (None without gRPC)."""
        self._loop = asyncio.get_running_loop()
        if self.port is not None:
            interceptors = [BearerAuth(self.token)] if self.token else []
            server = grpc.aio.server(interceptors=interceptors)
            pb_grpc.add_JaxServeServicer_to_server(self.servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server,
            )
            addr = f"{self.host}:{self.port}"
            if self.tls:
                creds = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])
                self.port = server.add_secure_port(addr, creds)
            else:
                self.port = server.add_insecure_port(addr)
        self.engine.start()
        if self.port is not None:
            await server.start()
            self._server = server
        if self.metrics_port is not None:
            self._metrics_http = self.metrics.serve(self.metrics_port, self.host)
            self.metrics_port = self._metrics_http[0].server_port  # the port bound (0 asks for a free one)
            log.info("Prometheus metrics on %s:%d/metrics", self.host, self.metrics_port)
        if self.http_port is not None:
            from jaxserve.serving.http_server import HttpFrontend  # FastAPI and uvicorn only when asked for

            self.http = HttpFrontend(self.engine, self.metrics, self.token, self.default_max_tokens, self.tls)
            self.http_port = await self.http.start(self.host, self.http_port)
            log.info("OpenAI-compatible HTTP on %s:%d", self.host, self.http_port)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.port is not None:
            log.info("jaxserve gRPC listening on %s:%d", self.host, self.port)
        return self.port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            r = self.health.set(name, status)
            if asyncio.iscoroutine(r):
                await r

    def _on_fatal(self, error: BaseException) -> None:
        """From the engine thread: the streams in flight already have the error; stop
        admitting (health NOT_SERVING, /health 503) and wake `serve` to exit."""
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._fail(error)))

    async def _fail(self, error: BaseException) -> None:
        """New requests already get UNAVAILABLE / 503 from the engine client (EngineDead)."""
        log.error("engine failed (%r): not serving; the process exits", error)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.failed.set()

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


def freeze_startup_heap() -> int:
    """Take every object alive once the server is up out of the garbage collector's scans (as
    vLLM does) and return how many that was. Start-up leaves ~0.25-0.55M objects (the model's modules,
    jax's, transformers' and FastAPI's tables) that live as long as the process; a full
    collection walks them all: 250-300 ms on the 56.4M bench model, during which no stream
    advances. CPython runs one whenever enough new objects have outlived two younger
    collections, so a server meets it at random. Frozen, a full collection walks only what
    serving allocated (0.03 ms right after). Only the serving process does this: frozen objects
    are never freed, which would keep every engine a test process drops alive."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _serve_forever(server: Server) -> int:
    await server.start()
    log.info("froze %d start-up objects out of the garbage collector's scans", freeze_startup_heap())
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if server.port is not None:
        print(f"jaxserve: serving on {server.host}:{server.port}", flush=True)
    if server.http is not None:
        print(f"jaxserve: OpenAI-compatible HTTP on http://{server.host}:{server.http_port}/v1", flush=True)
    stop, fail = asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(server.failed.wait())
    await asyncio.wait((stop, fail), return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if server.failed.is_set():
        await server.stop(grace=1.0)  # the streams in flight have their errors already
        print(f"jaxserve: the engine failed: {server.engine.error!r}; exiting", flush=True)
        return EXIT_ENGINE_FAILED
    fail.cancel()
    log.info("signal received: draining")
    await server.drain()
    return 0


def serve(engine: Engine | object, **kwargs) -> int:
    """Serve until SIGTERM/SIGINT (drain, 0) or an engine failure (EXIT_ENGINE_FAILED)."""
    return asyncio.run(_serve_forever(Server(engine, **kwargs)))
