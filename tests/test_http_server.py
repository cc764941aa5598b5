"""The OpenAI-compatible HTTP frontend against a real server on 127.0.0.1, with the official
`openai` client: the same engine as gRPC (one Server serves both), the same outputs as the
offline LLM, OpenAI's error bodies, aborts on disconnect, and SIGTERM draining both frontends."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import openai
import pytest
from conftest import TEST_MODEL
from conftest import pool_whole as _pool_whole

from jaxserve import LLM, SamplingParams
from jaxserve.serving.client import Client
from jaxserve.serving.server import Server

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


class ServerThread:
    """A jaxserve Server (gRPC and HTTP) on its own event loop in a background thread."""

    def __init__(self, llm: LLM, **kw):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(llm, port=0, http_port=0, **kw)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{self.port}"
        self.base_url = f"http://127.0.0.1:{self.server.http_port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


class _ClosingHandler(logging.StreamHandler):
    """A handler that owns its stream and closes it with itself, as absl's does."""

    def close(self):
        self.stream.close()
        super().close()


@pytest.fixture(scope="module")
def embedder_handler():
    """A handler of an embedding program's, in place before `served` starts its server."""
    handler = _ClosingHandler(io.StringIO())
    logging.getLogger("embedder").addHandler(handler)
    yield handler
    logging.getLogger("embedder").removeHandler(handler)


@pytest.fixture(scope="module")
def served(tok_model, tmp_path_factory, embedder_handler):
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
    st = ServerThread(llm, token=TOKEN, max_waiting=64)
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


def test_starting_the_server_leaves_the_process_logging_alone(served, embedder_handler):
    """uvicorn's default logging config runs dictConfig, which closes every handler in the
    process: a program embedding the server lost the streams its handlers own (absl's closed
    pytest's capture file). The server passes log_config=None; such a handler still writes."""
    handler = embedder_handler
    assert handler in logging.getLogger("embedder").handlers and not handler.stream.closed
    logging.getLogger("embedder").warning("still here")
    assert "still here" in handler.stream.getvalue()


def test_models_and_health(served):
    st, llm, _ = served
    models = _client(st).models.list()
    assert [m.id for m in models.data] == [llm.model_path.name]
    assert models.data[0].max_model_len == OPTS["max_model_len"]
    assert _client(st).models.retrieve(llm.model_path.name).id == llm.model_path.name
    with urllib.request.urlopen(st.base_url + "/health") as r:  # no token needed
        assert r.status == 200 and json.load(r) == {"status": "ok"}


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


def test_logprobs_as_text(served):
    st, llm, _ = served
    c = _client(st)
    kw = dict(model=_model(st), messages=CHATS[0], logprobs=True, top_logprobs=3, max_tokens=4, temperature=0)
    content = c.chat.completions.create(**kw).choices[0].logprobs.content
    ids = _ids(c.chat.completions.create(**kw, extra_body=IDS).choices[0].logprobs.content)
    assert [e.token for e in content] == [llm.tokenizer.decode([t]) for t in ids]
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the chosen token is the top one
        assert e.top_logprobs[0].token == e.token


def test_32_concurrent_streaming_chats(served):
    st, llm, ref = served

    async def one(c, conv):
        text, n = "", None
        stream = await c.chat.completions.create(
            model=_model(st),
            messages=conv,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            else:
                n = chunk.usage.completion_tokens
        return text, n

    async def main():
        c = openai.AsyncOpenAI(base_url=st.base_url + "/v1", api_key=TOKEN, max_retries=0)
        try:
            return await asyncio.gather(*(one(c, conv) for conv in MANY))
        finally:
            await c.close()

    got = asyncio.run(main())
    assert got == [(o.text, 16) for o in ref["many"]]
    _pool_whole(llm)


def test_a_client_that_disconnects_frees_its_pages(served):
    st, llm, _ = served
    cancelled = lambda: (
        st.server.metrics.registry.get_sample_value(  # noqa: E731
            "jaxserve_requests_total", {"outcome": "cancelled"}
        )
        or 0
    )
    before = cancelled()
    # streamed: close the response after two chunks
    stream = _client(st).chat.completions.create(
        model=_model(st), messages=CHATS[0], max_tokens=150, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(stream), next(stream)
    assert llm.scheduler.running
    stream.close()
    _pool_whole(llm)
    # not streamed: drop the connection while the request runs
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http_port)
    body = dict(model=_model(st), prompt="def f(x):", max_tokens=170, temperature=0, ignore_eos=True)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 10
    while not llm.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.002)
    conn.close()
    _pool_whole(llm)
    assert cancelled() == before + 2


BAD_CHAT = [
    (dict(temperature=-1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_completion_tokens=-3), "max_completion_tokens"),
    (dict(max_tokens=10**6), "max_tokens"),
    (dict(n=0), "n"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=True, top_logprobs=99), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content",
    ),
    (dict(messages=[{"role": "user", "content": "x " * 400}]), "messages"),  # the prompt alone is too long
    (dict(tools=[{"type": "function", "function": {"name": "f g"}}]), "tools[0].function.name"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
]
BAD_COMPLETION = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[1, 99999]), "prompt"),
    (dict(prompt=["a", ""]), "prompt"),  # the first prompt of the list is aborted
    (dict(max_tokens=0), "max_tokens"),  # 0 only with echo
    (dict(suffix="x"), "suffix"),
    (dict(best_of=2), "best_of"),
    (dict(logprobs=-1), "logprobs"),
    (dict(n=65), "n"),
    (dict(max_tokens=-1), "max_tokens"),
    # past int32: refused with the request, not raised in the step (which would fail every stream)
    (dict(extra_body={"top_k": 2**31}), "top_k"),
    (dict(max_tokens=2**31), "max_tokens"),
]


@pytest.mark.parametrize(
    "kind, kw, param",
    [("chat", kw, p) for kw, p in BAD_CHAT] + [("completion", kw, p) for kw, p in BAD_COMPLETION],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_every_bad_field_is_a_400_naming_it_and_serving_continues(served, kind, kw, param):
    st, *_ = served
    c = _client(st)
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            c.chat.completions.create(**{"model": _model(st), "messages": CHATS[0], **kw})
        else:
            c.completions.create(**{"model": _model(st), "prompt": "hello", **kw})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    r = c.chat.completions.create(model=_model(st), messages=CHATS[0], max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_malformed_body_unknown_model_auth_and_full_queue(served):
    st, llm, _ = served
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for body in (b"{not json", b'{"messages": [{"role": "user", "content": "x"}]}'):
        req = urllib.request.Request(st.base_url + "/v1/chat/completions", body, headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        err = json.load(e.value)["error"]
        assert e.value.code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == "model"  # the second body has no model
    with pytest.raises(openai.NotFoundError) as e:
        _client(st).chat.completions.create(model="gpt-4o", messages=CHATS[0])
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as e:
        _client(st, api_key="wrong").chat.completions.create(model=_model(st), messages=CHATS[0], max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(st, api_key="wrong").models.list()
    body = json.dumps(dict(model=_model(st), messages=CHATS[0], max_tokens=2)).encode()
    req = urllib.request.Request(st.base_url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # no Authorization header at all
        urllib.request.urlopen(req)
    assert e.value.code == 401 and json.load(e.value)["error"]["code"] == "invalid_api_key"
    with pytest.raises(grpc.RpcError) as e:  # and gRPC checks the same token
        Client(st.target).complete("hi", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    st.server.engine.max_waiting = 0  # no request may wait: the next one is refused
    try:
        with pytest.raises(openai.RateLimitError) as e:
            _client(st).chat.completions.create(model=_model(st), messages=CHATS[0], max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        st.server.engine.max_waiting = 64
    assert _client(st).chat.completions.create(model=_model(st), messages=CHATS[0], max_tokens=2).choices


def test_multi_turn_chat_reuses_the_previous_turns_kv(served):
    st, llm, _ = served
    c = _client(st)
    conv = [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": "def g(y): hello"}]
    first = c.chat.completions.create(model=_model(st), messages=conv, max_tokens=20, temperature=0)
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    conv += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "hello world"},
    ]
    second = c.chat.completions.create(model=_model(st), messages=conv, max_tokens=4, temperature=0)
    page = OPTS["page_size"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Turn one's prompt is a prefix of turn two's text, but its last token may be tokenized
    # differently there (a trailing blank line merges into one token at the end of a text):
    # every whole page before it is reused.
    assert cached >= (first.usage.prompt_tokens - 1) // page * page > 0
    assert llm.stats()["prefix_cache_hit_tokens"] - hits_before == cached
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_metrics_count_http_requests(served):
    st, *_ = served
    value = lambda name, **labels: st.server.metrics.registry.get_sample_value(name, labels) or 0  # noqa: E731
    before = (value("jaxserve_requests_total", outcome="length"), value("jaxserve_time_to_first_token_seconds_count"))
    r = _client(st).completions.create(model=_model(st), prompt="hello", max_tokens=3, temperature=0, stream=False)
    assert r.choices[0].finish_reason == "length"
    after = (value("jaxserve_requests_total", outcome="length"), value("jaxserve_time_to_first_token_seconds_count"))
    assert after == (before[0] + 1, before[1] + 1)


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


def test_a_huge_prompt_does_not_delay_a_running_stream(served, monkeypatch):
    """~1 MB of text over gRPC, then a ~1 MB chat message over HTTP: tokenization and template
    rendering (over a second each here) run in the engine client's worker thread, never on the
    event loop both frontends share nor on the engine's thread, so a concurrent stream keeps going.

    The oracle holds each big prompt's tokenization still, inside the real call path, until the
    concurrent stream has delivered 20 more tokens, then lets it finish. Were tokenization on the
    loop or the engine thread, the stream would stop there and the wait run out (60 s); no time is
    asserted (a bound on gaps between tokens flaked on the shared 2-core CPU)."""
    st, llm, _ = served
    core = st.server.engine.core
    big = ("def f(x):\n    return x + 1\n" * 40000)[:1_000_000]
    entered, release = threading.Event(), threading.Event()
    tokenize = core.tokenize

    def held(prompt):
        if len(repr(prompt)) > 500_000:  # the big prompt, as text or inside a Conversation
            entered.set()
            release.wait(60)
        return tokenize(prompt)

    monkeypatch.setattr(core, "tokenize", held)
    tokens: list[int] = []  # every token the concurrent stream receives
    stop = threading.Event()

    def streams():
        c = Client(st.target, token=TOKEN)
        while not stop.is_set():
            for r in c.generate([5, 6, 7], max_tokens=180, temperature=0, ignore_eos=True):
                tokens.extend(r.token_ids)

    def over_grpc():
        with pytest.raises(grpc.RpcError) as e:  # ~350k tokens: longer than the context
            Client(st.target, token=TOKEN).complete(big, max_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.value.details()

    def over_http():
        with pytest.raises(openai.BadRequestError) as e:
            _client(st).chat.completions.create(model=_model(st), messages=[{"role": "user", "content": big}])
        assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"

    errors: list[BaseException] = []

    def run(send):
        try:
            send()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    t = threading.Thread(target=streams)
    t.start()
    try:
        for send in (over_grpc, over_http):
            entered.clear()
            release.clear()
            sender = threading.Thread(target=run, args=(send,))
            sender.start()
            assert entered.wait(60), "the big prompt never reached tokenization"
            before, deadline = len(tokens), time.monotonic() + 60
            while len(tokens) < before + 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            moved = len(tokens) - before
            release.set()
            sender.join(120)
            assert not sender.is_alive()
            assert moved >= 20, f"the stream stalled while a prompt was tokenized: {moved} tokens in 60 s"
    finally:
        release.set()
        stop.set()
        t.join(30)
    assert not errors, errors
    _pool_whole(llm)


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
