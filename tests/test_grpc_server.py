"""The gRPC frontend against a real server on 127.0.0.1 (a free port), with real clients."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import pool_whole as _pool_whole

from jaxserve import LLM, SamplingParams
from jaxserve.serving.client import Client
from jaxserve.serving.server import Server
from jaxserve.v1 import jaxserve_pb2 as pb

OPTS = dict(max_slots=8, page_size=8, max_model_len=160, num_pages=160, token_buckets=(16, 32, 64))


class ServerThread:
    """A jaxserve Server on its own event loop in a background thread."""

    def __init__(self, llm: LLM, port: int | None = 0, **kw):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(llm, port=port, **kw)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{self.port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        prompt = [int(x) for x in rng.integers(3, 500, int(rng.integers(2, 60)))]
        if i % 3 == 2:
            sp = dict(max_tokens=int(rng.integers(1, 30)), temperature=0.8, top_p=0.9, seed=1000 + i, ignore_eos=True)
        else:
            sp = dict(max_tokens=int(rng.integers(1, 30)), temperature=0.0, ignore_eos=True)
        reqs.append((prompt, sp))
    return reqs


@pytest.fixture(scope="module")
def served(tok_model):
    llm = LLM(tok_model[0], **OPTS)
    reqs = _requests(64)
    texts = ["def f(x):", "hello world", "the quick"]
    # The oracle: LLM.generate on the same engine, before the server owns it.
    ref_ids = [o.token_ids for o in llm.generate([p for p, _ in reqs], [SamplingParams(**sp) for _, sp in reqs])]
    ref_text = [(o.text, o.token_ids) for o in llm.generate(texts, SamplingParams(max_tokens=20, temperature=0))]
    st = ServerThread(llm, max_waiting=64)
    yield st, llm, reqs, ref_ids, texts, ref_text
    st.stop()


def test_stream_equals_generate_text_and_ids(served):
    st, llm, reqs, ref_ids, texts, ref_text = served
    c = Client(st.target)
    for text, (rtext, rids) in zip(texts, ref_text):
        got, ids, last = c.complete(text, max_tokens=20)
        assert (got, ids) == (rtext, rids)
        assert last.usage.completion_tokens == len(ids) and last.finish_reason in (pb.STOP, pb.LENGTH)
    for (prompt, sp), ref in list(zip(reqs, ref_ids))[:6]:
        responses = list(c.generate(prompt, **sp))
        assert sum((list(r.token_ids) for r in responses), []) == ref
        assert all(r.finish_reason == 0 for r in responses[:-1]) and responses[-1].finish_reason == pb.LENGTH
        assert responses[-1].usage.prompt_tokens == len(prompt)


def test_64_concurrent_streams(served):
    st, llm, reqs, ref_ids, *_ = served

    def one(i):
        c = Client(st.target)
        try:
            return c.complete(reqs[i][0], **reqs[i][1])[1]
        finally:
            c.close()

    with ThreadPoolExecutor(64) as ex:
        got = list(ex.map(one, range(64)))
    assert got == ref_ids
    _pool_whole(llm)


def test_cancelled_stream_frees_its_pages(served):
    st, llm, *_ = served
    c = Client(st.target)
    stream = c.generate([5] * 40, max_tokens=100, temperature=0, ignore_eos=True)
    next(stream)
    next(stream)
    assert llm.scheduler.running
    stream.cancel()
    _pool_whole(llm)
    with pytest.raises(grpc.RpcError) as e:  # a deadline that expires aborts too
        list(c.generate([6] * 40, max_tokens=110, temperature=0, ignore_eos=True, timeout=0.05))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _pool_whole(llm)


def test_abort_rpc(served):
    st, llm, *_ = served
    c = Client(st.target)
    stream = c.generate([7] * 20, request_id="to-abort", max_tokens=100, temperature=0, ignore_eos=True)
    first = next(stream)
    assert first.request_id == "to-abort"
    assert c.abort("to-abort")
    rest = list(stream)
    assert rest[-1].finish_reason == pb.ABORT
    assert not c.abort("no-such-request")
    _pool_whole(llm)


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
    st, *_ = served
    c = Client(st.target)
    with pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(build(c)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    text, ids, last = c.complete([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True)
    assert len(ids) == 3


def test_health_reflection_and_model_info(served):
    st, llm, *_ = served
    c = Client(st.target)
    assert c.health() == "SERVING" and c.health("jaxserve.v1.JaxServe") == "SERVING"
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(c.channel).get_services()
    assert "jaxserve.v1.JaxServe" in services
    info = c.model_info()
    assert info.vocab_size == 512 and info.context_length == 160 and "prefix_caching" in info.features


def test_logprobs_over_grpc(served):
    st, llm, *_ = served
    c = Client(st.target)
    responses = list(c.generate([4, 8, 15], max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))
    lps = [lp for r in responses for lp in r.logprobs]
    ids = [t for r in responses for t in r.token_ids]
    assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 3 for lp in lps)
    assert all(lp.logprob >= lp.top[0].logprob - 1e-6 for lp in lps)  # greedy picks the top token


def test_metrics_endpoint(tok_model):
    import urllib.request

    llm = LLM(tok_model[0], **OPTS)
    st = ServerThread(llm, metrics_port=0)  # the server binds a free port and says which
    try:
        port = st.server.metrics_port
        assert port > 0
        Client(st.target).complete([1, 2, 3], max_tokens=5, temperature=0, ignore_eos=True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert re.search(r'jaxserve_requests_total\{outcome="length"\} 1\.0', body)
        assert "jaxserve_time_to_first_token_seconds_count 1.0" in body
        assert "jaxserve_kv_pages_total" in body and "jaxserve_prefix_cache_hit_rate" in body
    finally:
        st.stop()


def test_auth_and_full_queue(tok_model):
    llm = LLM(tok_model[0], **dict(OPTS, max_slots=1))
    st = ServerThread(llm, token="s3cret", max_waiting=1)
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
                return len(good.complete([3 + i] * 10, max_tokens=140, temperature=0, ignore_eos=True)[1])
            except grpc.RpcError as err:
                return err.code()

        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(one, range(6)))
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in results
        assert 140 in results and set(results) <= {140, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert good.complete([1, 2], max_tokens=3, temperature=0, ignore_eos=True)[1]  # still serving
    finally:
        st.stop()


def test_sigterm_drains_with_a_final_message(tok_model, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "serve",
        "--model",
        str(tok_model[0]),
        "--port",
        "0",
        "--grace",
        "0.5",
        "--max-slots",
        "2",
        "--page-size",
        "8",
        "--max-model-len",
        "160",
        "--num-pages",
        "64",
        "--no-compilation-cache",  # not default.gin's store in ~/.cache, which outlives the run
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        port = None
        for line in proc.stdout:
            m = re.search(r"serving on 127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "server did not start"
        c = Client(f"127.0.0.1:{port}")
        stream = c.generate([5] * 20, max_tokens=140, temperature=0, ignore_eos=True)
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # no RpcError: the stream ends with a final message
        last = (rest or [first])[-1]
        assert last.finish_reason in (pb.ABORT, pb.LENGTH)
        assert last.usage.completion_tokens == len(first.token_ids) + sum(len(r.token_ids) for r in rest)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
