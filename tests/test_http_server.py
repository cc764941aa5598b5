"""The OpenAI-compatible HTTP frontend over the jitted engine, end to end, against a real server on
127.0.0.1 with the official `openai` client: the same engine as gRPC (one Server serves both),
the same outputs as the offline LLM (the oracle), and the CLI's server with SIGTERM draining both
frontends. The frontend's own behaviour (framing, errors naming the field, auth, the queue bound,
aborts on disconnect, metrics) is tested on the fake engine in tests/test_http_frontend.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import grpc
import openai
import pytest
from conftest import TEST_MODEL
from conftest import pool_whole as _pool_whole
from servers import ServerThread, stream_chats

from jaxserve import LLM, SamplingParams
from jaxserve.serving.client import Client

OPTS = dict(max_slots=8, page_size=8, max_model_len=192, num_pages=400, token_buckets=(16, 32, 64))
TOKEN = "s3cret"
TEXTS = ["def f(x):", "hello world", "the quick brown"]
CHATS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "the quick brown fox"},
        {"role": "user", "content": "def f(x):"},
        {"role": "assistant", "content": "return x + 1"},
        {"role": "user", "content": "héllo wörld ☃"},
    ],
]
MANY = [[{"role": "user", "content": f"hello {i} world"}] for i in range(32)]
GREEDY = dict(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def served(tok_model, tmp_path_factory):
    """The conftest's tiny llama with a tokenizer, plus the shipped model's chat template; the
    reference outputs come from LLM.generate / LLM.chat on the same engine before it serves."""
    d = tmp_path_factory.mktemp("llama_chat")
    for f in tok_model[0].iterdir():
        shutil.copy(f, d)
    shutil.copy(TEST_MODEL / "chat_template.jinja", d)
    llm = LLM(d, **OPTS)
    ref = {
        "text": llm.generate(TEXTS, SamplingParams(**GREEDY)),
        "chat": llm.chat(CHATS, SamplingParams(**GREEDY)),
        "many": llm.chat(MANY, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
    }
    st = ServerThread(llm, http_port=0, token=TOKEN, max_waiting=64)
    yield st, llm, ref
    st.stop()


def _client(st, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.base_url + "/v1", api_key=kw.pop("api_key", TOKEN), max_retries=0, **kw)


def _model(st) -> str:
    return st.server.http.model_name


def _ids(logprobs_content) -> list[int]:
    """Token ids from logprobs entries named "token_id:N" (return_tokens_as_token_ids)."""
    return [int(e.token.split(":")[1]) for e in logprobs_content]


IDS = {"return_tokens_as_token_ids": True}


def test_completions_equal_generate(served):
    st, llm, ref = served
    c = _client(st)
    for text, want in zip(TEXTS, ref["text"]):
        r = c.completions.create(model=_model(st), prompt=text, logprobs=0, extra_body=IDS, **GREEDY)
        ch = r.choices[0]
        assert ch.text == want.text and ch.finish_reason == want.finish_reason
        assert [int(t.split(":")[1]) for t in ch.logprobs.tokens] == want.token_ids
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(
            c.completions.create(
                model=_model(st),
                prompt=text,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=0,
                extra_body=IDS,
                **GREEDY,
            )
        )
        assert "".join(x.choices[0].text for x in chunks[:-1]) == want.text
        assert sum(([int(t.split(":")[1]) for t in x.choices[0].logprobs.tokens] for x in chunks[:-1]), []) == (
            want.token_ids
        )
        assert chunks[-2].choices[0].finish_reason == want.finish_reason and not chunks[-1].choices
        usage = chunks[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    r = c.completions.create(model=_model(st), prompt=ref["text"][0].prompt_token_ids, **GREEDY)  # token ids
    assert r.choices[0].text == ref["text"][0].text


def test_chat_equals_llm_chat(served):
    st, llm, ref = served
    c = _client(st)
    for conv, want in zip(CHATS, ref["chat"]):
        r = c.chat.completions.create(model=_model(st), messages=conv, logprobs=True, extra_body=IDS, **GREEDY)
        ch = r.choices[0]
        assert ch.message.role == "assistant" and ch.message.content == want.text
        assert _ids(ch.logprobs.content) == want.token_ids and ch.finish_reason == want.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
        assert r.usage.prompt_tokens_details.cached_tokens >= 0
        chunks = list(
            c.chat.completions.create(
                model=_model(st),
                messages=conv,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
                top_logprobs=2,
                extra_body=IDS,
                **GREEDY,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(x.choices[0].delta.content or "" for x in chunks[:-1]) == want.text
        assert sum((_ids(x.choices[0].logprobs.content) for x in chunks[1:-1]), []) == want.token_ids
        assert all(len(e.top_logprobs) == 2 for x in chunks[1:-1] for e in x.choices[0].logprobs.content)
        assert chunks[-2].choices[0].finish_reason == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    # the same conversation over gRPC
    g = Client(st.target, token=TOKEN)
    text, ids, last = g.complete(CHATS[1], max_tokens=12, temperature=0)
    assert (text, ids) == (ref["chat"][1].text, ref["chat"][1].token_ids)
    assert last.usage.prompt_tokens == len(ref["chat"][1].prompt_token_ids)


def test_32_concurrent_streaming_chats(served):
    st, llm, ref = served
    got = stream_chats(
        st.base_url, TOKEN, _model(st), MANY, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got == [(o.text, 16) for o in ref["many"]]
    _pool_whole(llm)


def test_llm_chat_and_a_model_without_a_template(served):
    st, llm, ref = served
    tok = llm.tokenizer
    template, tok.chat_template = tok.chat_template, None  # as if the checkpoint had none
    try:
        with pytest.raises(openai.BadRequestError) as e:
            _client(st).chat.completions.create(model=_model(st), messages=CHATS[0], max_tokens=2)
        assert e.value.body["param"] == "messages" and "no chat template" in e.value.body["message"]
        with pytest.raises(grpc.RpcError) as e:
            Client(st.target, token=TOKEN).complete(CHATS[0], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in e.value.details()
        with pytest.raises(ValueError, match="^messages: .*no chat template"):
            llm.core.render_chat(CHATS[0])
    finally:
        tok.chat_template = template
    ids = tok.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)
    assert ref["chat"][1].prompt_token_ids == list(ids)  # LLM.chat rendered with the template
    assert len(ref["chat"]) == 2 and len(ref["many"]) == 32


def test_cli_serves_the_small_model_over_both_and_sigterm_drains(capsys):
    """`jaxserve serve --http-port`: the shipped model and its plain chat template end to end,
    over HTTP and gRPC (`jaxserve client --chat`), then SIGTERM ends a running HTTP stream with
    a final chunk and [DONE], and the process exits 0."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(TEST_MODEL), "--port", "0", "--http-port", "0"]
    cmd += ["--grace", "0.5"]
    cmd += ["--max-slots", "2", "--max-model-len", "256", "--token-buckets", "32,64", "--no-compilation-cache"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        grpc_port = http_port = None
        for line in proc.stdout:
            if m := re.search(r"serving on 127\.0\.0\.1:(\d+)", line):
                grpc_port = int(m.group(1))
            if m := re.search(r"OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1", line):
                http_port = int(m.group(1))
                break
        assert grpc_port and http_port, "server did not start"
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["target"]
        conv = [{"role": "user", "content": "Write a function that adds two numbers."}]
        r = c.chat.completions.create(model="target", messages=conv, max_tokens=24, temperature=0)
        from jaxserve.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(TEST_MODEL)
        assert r.usage.prompt_tokens == len(
            tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
        )
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
        g = Client(f"127.0.0.1:{grpc_port}")
        text, ids, last = g.complete(conv, max_tokens=24, temperature=0)
        assert text == r.choices[0].message.content and last.usage.prompt_tokens == r.usage.prompt_tokens
        from jaxserve.cli import main

        assert (
            main(["client", "--chat", conv[0]["content"], "--target", f"127.0.0.1:{grpc_port}", "--max-tokens", "24"])
            == 0
        )
        assert capsys.readouterr().out == text + "\n"
        stream = c.chat.completions.create(
            model="target", messages=conv, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(stream), next(stream)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # ends normally: a final chunk with a finish reason, then [DONE]
        assert rest and rest[-1].choices[0].finish_reason in ("abort", "length")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
