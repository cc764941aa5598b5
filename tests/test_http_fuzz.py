"""Fuzz the OpenAI-compatible HTTP API with schemathesis, from the server's own OpenAPI document:
valid bodies (positive) and bodies that break the schema (negative) for every operation. The
oracle: no 5xx, ever; the server answers a plain request after the run; every KV page returns to
the pool (an invalid request leaks nothing, a valid one frees what it took). The server runs on
the fake engine (engine/fake_engine.py): what is fuzzed is the frontend, and the fake has the
real scheduler, KV manager and validation, so a leak or a 5xx shows as it would on the jitted
engine, at a fraction of the time a request costs there."""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from conftest import pool_whole
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from servers import ServerThread

from jaxserve.engine.fake_engine import FakeEngine

pytestmark = pytest.mark.fast

# A short context bounds each valid request's work (max_tokens fills at most 96 tokens).
OPTS = dict(max_slots=4, page_size=8, max_model_len=96, num_pages=64, token_buckets=(16, 32))


@pytest.fixture(scope="module")
def server():
    llm = FakeEngine(step_seconds=0, **OPTS)  # no stream here needs to last
    st = ServerThread(llm, port=None, http_port=0, max_waiting=64)
    yield f"http://127.0.0.1:{st.server.http_port}", llm
    st.stop()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_and_nothing_leaks(server, mode):
    base, llm = server
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    seen: dict[int, int] = {}
    model = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=10))["data"][0]["id"]
    for op in operations:
        if mode is GenerationMode.NEGATIVE and not len(op.body):
            continue  # nothing to break (GET /health, /v1/models/{any string}): no negative case exists

        @settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(mode))
        def check(case):
            if isinstance(case.body, dict):  # the served model's name: a random one only tests the 404
                case.body["model"] = model
            response = case.call(base_url=base, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.as_curl_command(), response.text[:500])

        check()
    if mode is GenerationMode.POSITIVE:
        assert seen.get(200, 0) > 0  # the valid bodies were served, not all refused
    else:
        assert seen.get(400, 0) + seen.get(422, 0) > 0  # the broken bodies were refused, naming the field
    pool_whole(llm, timeout=60)
    with urllib.request.urlopen(f"{base}/health", timeout=10) as r:  # still serving
        assert json.load(r) == {"status": "ok"}
