"""The gRPC frontend on the fake engine (engine/fake_engine.py), against a real server on
127.0.0.1 with real clients: cancellation and deadlines free pages, Abort, every invalid field
refused as INVALID_ARGUMENT naming it, health, reflection, model info, logprobs, metrics, auth
and the waiting-queue bound. The oracle is the fake model's own tokens and the pool's invariants;
outputs equal to LLM.generate over the jitted engine are tests/test_grpc_server.py's."""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import pool_whole
from servers import ServerThread

from jaxserve.engine.fake_engine import FakeEngine
from jaxserve.serving.client import Client
from jaxserve.v1 import jaxserve_pb2 as pb

pytestmark = pytest.mark.fast

OPTS = dict(max_slots=8, page_size=8, max_model_len=160, num_pages=160, token_buckets=(16, 32, 64))
# A step's time: a stream of 100 tokens lasts a second, long enough for a client on the loaded CPU
# to cancel it while it runs, and for the queue-bound test's requests to meet a full queue.
STEP_SECONDS = 0.01


@pytest.fixture(scope="module")
def served():
    fake = FakeEngine(step_seconds=STEP_SECONDS, **OPTS)
    st = ServerThread(fake, max_waiting=64)
    yield st, fake
    st.stop()


def test_stream_carries_the_engines_tokens(served):
    st, fake = served
    c = Client(st.target)
    responses = list(c.generate([5, 6, 7], max_tokens=9, ignore_eos=True))
    assert sum((list(r.token_ids) for r in responses), []) == fake.model.tokens([5, 6, 7], 9)
    assert "".join(r.text for r in responses) == fake.tokenizer.decode(fake.model.tokens([5, 6, 7], 9))
    assert all(r.finish_reason == 0 for r in responses[:-1]) and responses[-1].finish_reason == pb.LENGTH
    assert (responses[-1].usage.prompt_tokens, responses[-1].usage.completion_tokens) == (3, 9)


def test_cancelled_stream_frees_its_pages(served):
    st, fake = served
    c = Client(st.target)
    stream = c.generate([5] * 40, max_tokens=100, ignore_eos=True)
    next(stream)
    next(stream)
    assert fake.scheduler.running
    stream.cancel()
    pool_whole(fake)
    with pytest.raises(grpc.RpcError) as e:  # a deadline that expires aborts too
        list(c.generate([6] * 40, max_tokens=110, ignore_eos=True, timeout=0.05))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pool_whole(fake)


def test_abort_rpc(served):
    st, fake = served
    c = Client(st.target)
    stream = c.generate([7] * 20, request_id="to-abort", max_tokens=100, ignore_eos=True)
    first = next(stream)
    assert first.request_id == "to-abort"
    assert c.abort("to-abort")
    rest = list(stream)
    assert rest[-1].finish_reason == pb.ABORT
    assert not c.abort("no-such-request")
    pool_whole(fake)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda c: pb.GenerateRequest(), "prompt"),
        (lambda c: c.request([1, 2, 3], max_tokens=-1), "max_tokens"),
        (lambda c: c.request([1, 2, 3], temperature=-1.0), "temperature"),
        (lambda c: c.request([1, 2, 3], top_k=-2), "top_k"),
        (lambda c: c.request([1, 2, 3], top_p=1.5), "top_p"),
        (lambda c: c.request([1, 2, 3], logprobs=-1), "logprobs"),
        (lambda c: c.request([1, 2, 99999]), "prompt_token_ids"),
        (lambda c: c.request([], max_tokens=3), "prompt"),
        (lambda c: c.request("", max_tokens=3), "prompt"),
        (lambda c: c.request([1] * 150, max_tokens=20), "max_tokens"),
    ],
)
def test_invalid_requests_are_rejected_and_serving_continues(served, build, field):
    st, _ = served
    c = Client(st.target)
    with pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(build(c)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    text, ids, last = c.complete([1, 2, 3], max_tokens=3, ignore_eos=True)
    assert len(ids) == 3


def test_health_reflection_and_model_info(served):
    st, _ = served
    c = Client(st.target)
    assert c.health() == "SERVING" and c.health("jaxserve.v1.JaxServe") == "SERVING"
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(c.channel).get_services()
    assert "jaxserve.v1.JaxServe" in services
    info = c.model_info()
    assert info.vocab_size == 512 and info.context_length == 160 and "prefix_caching" in info.features


def test_logprobs_over_grpc(served):
    st, _ = served
    c = Client(st.target)
    responses = list(c.generate([4, 8, 15], max_tokens=4, logprobs=3, ignore_eos=True))
    lps = [lp for r in responses for lp in r.logprobs]
    ids = [t for r in responses for t in r.token_ids]
    assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 3 for lp in lps)
    assert all(lp.logprob >= lp.top[0].logprob - 1e-6 for lp in lps)  # the chosen token is the top one


def test_metrics_endpoint():
    fake = FakeEngine(step_seconds=STEP_SECONDS, **OPTS)
    st = ServerThread(fake, metrics_port=0)  # the server binds a free port and says which
    try:
        port = st.server.metrics_port
        assert port > 0
        Client(st.target).complete([1, 2, 3], max_tokens=5, ignore_eos=True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert re.search(r'jaxserve_requests_total\{outcome="length"\} 1\.0', body)
        assert "jaxserve_time_to_first_token_seconds_count 1.0" in body
        assert "jaxserve_kv_pages_total" in body and "jaxserve_prefix_cache_hit_rate" in body
    finally:
        st.stop()


def test_auth_and_full_queue():
    fake = FakeEngine(step_seconds=STEP_SECONDS, **dict(OPTS, max_slots=1))
    st = ServerThread(fake, token="s3cret", max_waiting=1)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(Client(st.target).generate([1, 2], max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(Client(st.target, token="wrong").generate([1, 2], max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = Client(st.target, token="s3cret")
        assert good.health() == "SERVING"

        # one slot and one waiting place: of 6 simultaneous long requests some must be refused
        def one(i):
            try:
                return len(good.complete([3 + i] * 10, max_tokens=140, ignore_eos=True)[1])
            except grpc.RpcError as err:
                return err.code()

        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(one, range(6)))
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in results
        assert 140 in results and set(results) <= {140, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert good.complete([1, 2], max_tokens=3, ignore_eos=True)[1]  # still serving
    finally:
        st.stop()
