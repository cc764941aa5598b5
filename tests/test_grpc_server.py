"""The gRPC frontend over the jitted engine, end to end, against a real server on 127.0.0.1 (a
free port) with real clients: streams equal to LLM.generate (the oracle), 64 at once, both
frontends ranking a tie alike, and the CLI's server draining on SIGTERM. The frontend's own
behaviour (cancellation, Abort, invalid fields, health, metrics, auth, the queue bound) is tested
on the fake engine in tests/test_grpc_frontend.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import pool_whole as _pool_whole
from servers import ServerThread

from jaxserve import LLM, SamplingParams
from jaxserve.serving.client import Client
from jaxserve.v1 import jaxserve_pb2 as pb

OPTS = dict(max_slots=8, page_size=8, max_model_len=160, num_pages=160, token_buckets=(16, 32, 64))


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


PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tied(tok_model, tmp_path_factory):
    """The conftest's tiny llama with one more token tied for the top after PROMPT: its lm_head
    row copies the top token's row, so the two logits are equal bit for bit. Returns (llm, pair)."""
    import torch
    from safetensors.numpy import load_file, save_file

    with torch.no_grad():
        top = int(tok_model[1](torch.tensor([PROMPT])).logits[0, -1].argmax())
    pair = (top, (top + 1) % 512 or 2)
    d = tmp_path_factory.mktemp("tied_rows")
    for f in tok_model[0].iterdir():
        shutil.copy(f, d)
    weights = load_file(d / "model.safetensors")
    weights["lm_head.weight"][pair[1]] = weights["lm_head.weight"][pair[0]]
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return LLM(d, max_slots=1, page_size=8, max_model_len=160, num_pages=64, token_buckets=(16, 32)), pair


def test_grpc_and_http_rank_a_tie_alike(tied):
    """Both frontends format top logprobs with one conversion (client.split_logprobs): with two
    tokens tied for the top, the same order comes back from each."""
    llm, pair = tied
    st = ServerThread(llm, http_port=0)
    try:
        body = {"model": st.server.http.model_name, "prompt": PROMPT, "max_tokens": 1, "logprobs": 3, "temperature": 0}
        req = urllib.request.Request(
            st.base_url + "/v1/completions",
            json.dumps({**body, "return_tokens_as_token_ids": True}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
        http_top = [int(k.removeprefix("token_id:")) for k in out["choices"][0]["logprobs"]["top_logprobs"][0]]
        (r,) = [r for r in Client(st.target).generate(PROMPT, max_tokens=1, temperature=0, logprobs=3) if r.logprobs]
        grpc_top = [t.token_id for t in r.logprobs[0].top]
        assert set(http_top[:2]) == set(pair) and r.token_ids[0] == min(pair)  # the tie, and greedy's pick
        assert http_top == grpc_top
    finally:
        st.stop()
