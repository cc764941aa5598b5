"""The server process (serving/server.py) on the fake engine (engine/fake_engine.py) against real
clients on 127.0.0.1: the waiting-queue bound (HTTP 429 / RESOURCE_EXHAUSTED, the rest served),
HTTP-only serving, a loud death when an engine step raises (every stream ends with an error,
health goes NOT_SERVING, new requests are refused, `serve` exits non-zero) and the frozen
start-up heap of a serving process. Nothing here depends on what the model computes; the
jitted engine's servers are tests/test_grpc_server.py and tests/test_http_server.py."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import pool_whole
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import ServerThread

from jaxserve.engine.fake_engine import FakeEngine
from jaxserve.serve_config import ServeConfig
from jaxserve.serving.client import Client

pytestmark = pytest.mark.fast

OPTS = dict(max_slots=1, page_size=8, max_model_len=160, num_pages=64, token_buckets=(16, 32))


@pytest.fixture(scope="module")
def llm():
    """A fake engine core (the name is the tests' from when they built an LLM), whose steps take
    as long as a small model's on this CPU: a LONG request holds its slot for 1.5 s."""
    return FakeEngine(step_seconds=0.01, **OPTS)


def _request(base: str, method: str, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP call to the server at base (http://HOST:PORT)."""
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


LONG = 150  # tokens a queue-bound request runs: most of the 160-token context


def _complete(base: str, model: str, max_tokens: int = LONG) -> tuple[int, dict]:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}
    return _request(base, "POST", "/v1/completions", body)


def test_queue_bound_refuses_past_it_and_serves_the_rest(llm):
    """One slot and max_waiting=2: of 6 requests sent at once, at most 1 running + 2 waiting
    are taken (2 if the first has not started running when the others arrive); the others get
    429 over HTTP and RESOURCE_EXHAUSTED over gRPC, and every taken one runs to its length.
    Each asks for LONG (150) tokens of the 160-token context, so the first holds its slot long
    enough for a client thread the noisy CPU delays to still find the queue full."""
    st = ServerThread(llm, http_port=0, max_waiting=2)
    try:
        base, model = f"http://127.0.0.1:{st.server.http_port}", st.server.http.model_name
        with ThreadPoolExecutor(6) as ex:
            responses = list(ex.map(lambda _: _complete(base, model), range(6)))
        ok = [b for status, b in responses if status == 200]
        refused = [b for status, b in responses if status == 429]
        assert len(ok) + len(refused) == 6
        assert 2 <= len(ok) <= 3, [status for status, _ in responses]
        assert all(b["choices"][0]["finish_reason"] == "length" for b in ok)
        assert all(b["error"]["code"] == "rate_limit_exceeded" for b in refused)
        pool_whole(llm)

        def grpc_call(_):
            try:
                return sum(
                    len(r.token_ids) for r in Client(st.target).generate([5, 6, 7], max_tokens=LONG, ignore_eos=True)
                )
            except grpc.RpcError as e:
                return e.code()

        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(grpc_call, range(6)))
        served = [r for r in results if r == LONG]
        assert len(served) + results.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6, results
        assert 2 <= len(served) <= 3, results
        pool_whole(llm)
    finally:
        st.stop()


def test_http_only_server(llm):
    with pytest.raises(ValueError, match="ServeConfig.port"):
        ServeConfig(port=None, http_port=None)
    assert ServeConfig(port=None, http_port=0).server_options()["port"] is None
    st = ServerThread(llm, port=None, http_port=0)
    assert st.port is None
    try:
        base = f"http://127.0.0.1:{st.server.http_port}"
        name = _request(base, "GET", "/v1/models")[1]["data"][0]["id"]
        status, body = _request(base, "POST", "/v1/completions", {"model": name, "prompt": [5, 6], "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert st.server._server is None  # no gRPC server was bound
    finally:
        st.stop()


def _stream_events(base: str, model: str, max_tokens: int) -> list[dict]:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        lines = conn.getresponse().read().decode().splitlines()  # the whole stream, until the server ends it
    finally:
        conn.close()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_engine_failure_fails_streams_and_stops_serving(llm):
    """Runs last in this module: the engine it breaks is not used again."""
    st = ServerThread(llm, http_port=0, max_waiting=8)
    base = f"http://127.0.0.1:{st.server.http_port}"
    model = st.server.http.model_name
    real_step, calls = llm.step, []

    def failing_step():  # fails once all three requests are in flight and have made a few steps
        calls.append(len(st.server.engine.in_flight) == 3)
        if sum(calls) > 3:
            raise RuntimeError("injected step failure")
        return real_step()

    llm.step = failing_step
    try:
        with ThreadPoolExecutor(3) as ex:
            streams = [ex.submit(_stream_events, base, model, 100) for _ in range(3)]
            results = [f.result(timeout=30) for f in streams]
        for events in results:  # every stream ends with an OpenAI error body, none hangs
            assert "error" in events[-1] and "injected step failure" in events[-1]["error"]["message"]
        deadline = time.monotonic() + 10
        while not st.server.failed.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert st.server.failed.is_set()
        assert _request(base, "GET", "/health")[0] == 503
        status, body = _request(base, "POST", "/v1/completions", {"model": model, "prompt": [5], "max_tokens": 2})
        assert status == 503 and "engine failed" in body["error"]["message"]
        with grpc.insecure_channel(st.target) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                list(Client(st.target).generate([5, 6], max_tokens=2))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        del llm.step  # the class's step again
        st.stop()


SERVE_AND_FAIL = """
import sys
from jaxserve.engine.fake_engine import FakeEngine
from jaxserve.serving import server
engine = FakeEngine(**{opts!r})
real, calls = engine.step, []
def step():
    calls.append(1)
    if len(calls) > 3:
        raise RuntimeError("injected step failure")
    return real()
engine.step = step
sys.exit(server.serve(engine, port=0, http_port=0))
"""


def test_serve_exits_nonzero_when_the_engine_fails():
    """The process a supervisor watches: after the failure it exits non-zero by itself."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_AND_FAIL.format(opts=OPTS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        base = None
        for line in proc.stdout:
            if "OpenAI-compatible HTTP on" in line:
                base = line.split(" on ")[1].strip().removesuffix("/v1")
                break
        assert base is not None, "the server did not start"
        model = _request(base, "GET", "/v1/models")[1]["data"][0]["id"]
        events = _stream_events(base, model, 100)
        assert "injected step failure" in events[-1]["error"]["message"]
        assert proc.wait(timeout=30) == 1
        assert "the engine failed" in proc.stdout.read()
    finally:
        proc.kill()


SERVE_AND_COUNT_OBJECTS = """
import gc, json, logging, os, signal, sys, threading, time, urllib.request
from jaxserve.engine.fake_engine import FakeEngine
from jaxserve.serving import server
ports = []
class Port(logging.Handler):  # the HTTP port the server bound (it is given 0), from its log line
    def emit(self, record):
        if record.msg.startswith("OpenAI-compatible HTTP on"):
            ports.append(record.args[1])
logging.getLogger("jaxserve.server").addHandler(Port())
logging.getLogger("jaxserve.server").setLevel(logging.INFO)
engine = FakeEngine(**{opts!r})
gc.collect()
before = len(gc.get_objects())
def probe():
    deadline = time.monotonic() + 60
    while (gc.get_freeze_count() == 0 or not ports) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        # one request served after the freeze: the server still answers, its objects are young
        base = f"http://127.0.0.1:{{ports[0]}}"
        model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
        body = json.dumps({{"model": model, "prompt": [5, 6, 7], "max_tokens": 4}}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {{"Content-Type": "application/json"}})
        assert json.load(urllib.request.urlopen(req))["choices"][0]["text"] is not None
        print("OBJECTS", before, gc.get_freeze_count(), len(gc.get_objects()), flush=True)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=probe, daemon=True).start()
sys.exit(server.serve(engine, port=None, http_port=0))
"""


def test_serve_freezes_the_startup_heap():
    """A full garbage collection in a serving process walks only what serving allocated, not the
    ~0.5M objects start-up leaves (a 250-300 ms stall of every stream when it walked them)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_AND_COUNT_OBJECTS.format(opts=OPTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("OBJECTS")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    before, frozen, tracked = map(int, lines[0].split()[1:])
    assert frozen >= 0.9 * before  # start-up's objects left the scans...
    assert tracked < 0.1 * before  # ...and what a full collection walks now is serving's own
