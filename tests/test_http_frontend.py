"""The OpenAI-compatible HTTP frontend on the fake engine (engine/fake_engine.py: the real
scheduler, KV manager and detokenizer, tokens from a fixed function), against a real server on
127.0.0.1 with the official `openai` client: routing, streaming framing, OpenAI's error bodies
naming the field, auth, the queue bound, aborts on disconnect, metrics, prefix-cache reuse, and
a huge prompt that never stalls the event loop. The oracle is the fake model's own tokens
(`FakeModel.tokens`) and the pool's invariants; the same server over the jitted engine, with
outputs equal to LLM.generate and LLM.chat, is tests/test_http_server.py."""

from __future__ import annotations

import http.client
import io
import json
import logging
import threading
import time
import urllib.request

import grpc
import openai
import pytest
from conftest import pool_whole
from servers import ServerThread, stream_chats

from jaxserve.engine.fake_engine import FakeEngine
from jaxserve.serving.client import Client

pytestmark = pytest.mark.fast

OPTS = dict(max_slots=8, page_size=8, max_model_len=192, num_pages=400, token_buckets=(16, 32, 64))
# A step's time: a stream of 150 tokens lasts 1.5 s, so a client on the loaded CPU that reads two
# chunks still finds it running, as it would on the jitted engine.
STEP_SECONDS = 0.01
TOKEN = "s3cret"
CHAT = [{"role": "user", "content": "w9 w10 w11"}]
MANY = [[{"role": "user", "content": f"w{i + 3} w4"}] for i in range(32)]
IDS = {"return_tokens_as_token_ids": True}


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
def served(embedder_handler):
    fake = FakeEngine(step_seconds=STEP_SECONDS, **OPTS)
    st = ServerThread(fake, token=TOKEN, max_waiting=64, http_port=0)
    yield st, fake
    st.stop()


def _client(st, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.base_url + "/v1", api_key=kw.pop("api_key", TOKEN), max_retries=0, **kw)


def _ids(logprobs_content) -> list[int]:
    """Token ids from logprobs entries named "token_id:N" (return_tokens_as_token_ids)."""
    return [int(e.token.split(":")[1]) for e in logprobs_content]


def test_starting_the_server_leaves_the_process_logging_alone(served, embedder_handler):
    """uvicorn's default logging config runs dictConfig, which closes every handler in the
    process: a program embedding the server lost the streams its handlers own (absl's closed
    pytest's capture file). The server passes log_config=None; such a handler still writes."""
    handler = embedder_handler
    assert handler in logging.getLogger("embedder").handlers and not handler.stream.closed
    logging.getLogger("embedder").warning("still here")
    assert "still here" in handler.stream.getvalue()


def test_models_and_health(served):
    st, fake = served
    models = _client(st).models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert models.data[0].max_model_len == OPTS["max_model_len"]
    assert _client(st).models.retrieve("fake").id == "fake"
    with urllib.request.urlopen(st.base_url + "/health") as r:  # no token needed
        assert r.status == 200 and json.load(r) == {"status": "ok"}


def test_completion_streamed_and_not_carry_the_engines_tokens(served):
    """Both framings deliver exactly the engine's tokens, text, finish reason and usage."""
    st, fake = served
    c, prompt = _client(st), [5, 6, 7]
    want = fake.model.tokens(prompt, 12)
    text = fake.tokenizer.decode(want)
    r = c.completions.create(model="fake", prompt=prompt, max_tokens=12, logprobs=0, extra_body=IDS)
    ch = r.choices[0]
    assert (ch.text, ch.finish_reason) == (text, "length")
    assert [int(t.split(":")[1]) for t in ch.logprobs.tokens] == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 12, 15)
    chunks = list(
        c.completions.create(
            model="fake", prompt="w5 w6 w7", max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(x.choices[0].text for x in chunks[:-1]) == text
    assert chunks[-2].choices[0].finish_reason == "length" and not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 12)


def test_stop_strings_n_and_chat_framing(served):
    st, fake = served
    c = _client(st)
    ids = fake.render_chat(CHAT)
    want = [fake.model.tokens(ids, 8, index=i) for i in range(2)]
    stop = fake.tokenizer.decode(want[0][3:5])  # words 3 and 4 of the first completion
    r = c.chat.completions.create(model="fake", messages=CHAT, max_tokens=8, n=2, stop=[stop])
    got = {ch.index: ch for ch in r.choices}
    assert got[0].message.content == fake.tokenizer.decode(want[0][:3]) + " " and got[0].finish_reason == "stop"
    assert got[1].message.content == fake.tokenizer.decode(want[1]) and got[1].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="fake", messages=CHAT, max_tokens=8, stream=True, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum((_ids_of(fake, x) for x in chunks[1:]), []) == want[0]
    assert chunks[-1].choices[0].finish_reason == "length"


def _ids_of(fake, chunk) -> list[int]:
    lp = chunk.choices[0].logprobs
    return [fake.tokenizer.convert_tokens_to_ids(e.token.strip()) for e in lp.content] if lp else []


def test_logprobs_as_text(served):
    st, fake = served
    c = _client(st)
    kw = dict(model="fake", messages=CHAT, logprobs=True, top_logprobs=3, max_tokens=4, temperature=0)
    content = c.chat.completions.create(**kw).choices[0].logprobs.content
    ids = _ids(c.chat.completions.create(**kw, extra_body=IDS).choices[0].logprobs.content)
    assert ids == fake.model.tokens(fake.render_chat(CHAT), 4)
    assert [e.token for e in content] == [fake.tokenizer.decode([t]) for t in ids]
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # the chosen token is the top one
        assert e.top_logprobs[0].token == e.token


def test_32_concurrent_streaming_chats(served):
    st, fake = served
    got = stream_chats(st.base_url, TOKEN, "fake", MANY, max_tokens=16, extra_body={"ignore_eos": True})
    assert got == [(fake.tokenizer.decode(fake.model.tokens(fake.render_chat(conv), 16)), 16) for conv in MANY]
    pool_whole(fake)


def test_a_client_that_disconnects_frees_its_pages(served):
    st, fake = served
    cancelled = lambda: (
        st.server.metrics.registry.get_sample_value(  # noqa: E731
            "jaxserve_requests_total", {"outcome": "cancelled"}
        )
        or 0
    )
    before = cancelled()
    # streamed: close the response after two chunks
    stream = _client(st).chat.completions.create(
        model="fake", messages=CHAT, max_tokens=150, stream=True, extra_body={"ignore_eos": True}
    )
    next(stream), next(stream)
    assert fake.scheduler.running
    stream.close()
    pool_whole(fake)
    # not streamed: drop the connection while the request runs
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http_port)
    body = dict(model="fake", prompt="w5 w6", max_tokens=170, ignore_eos=True)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 10
    while not fake.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.002)
    conn.close()
    pool_whole(fake)
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
    st, _ = served
    c = _client(st)
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            c.chat.completions.create(**{"model": "fake", "messages": CHAT, **kw})
        else:
            c.completions.create(**{"model": "fake", "prompt": "hello", **kw})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    r = c.chat.completions.create(model="fake", messages=CHAT, max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_malformed_body_unknown_model_auth_and_full_queue(served):
    st, _ = served
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for body in (b"{not json", b'{"messages": [{"role": "user", "content": "x"}]}'):
        req = urllib.request.Request(st.base_url + "/v1/chat/completions", body, headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        err = json.load(e.value)["error"]
        assert e.value.code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == "model"  # the second body has no model
    with pytest.raises(openai.NotFoundError) as e:
        _client(st).chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as e:
        _client(st, api_key="wrong").chat.completions.create(model="fake", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(st, api_key="wrong").models.list()
    body = json.dumps(dict(model="fake", messages=CHAT, max_tokens=2)).encode()
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
            _client(st).chat.completions.create(model="fake", messages=CHAT, max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        st.server.engine.max_waiting = 64
    assert _client(st).chat.completions.create(model="fake", messages=CHAT, max_tokens=2).choices


def test_multi_turn_chat_reuses_the_previous_turns_kv(served):
    st, fake = served
    c = _client(st)
    conv = [{"role": "system", "content": "w20 w21 w22 w23"}, {"role": "user", "content": "w30 w31 w32 w33 w34"}]
    first = c.chat.completions.create(model="fake", messages=conv, max_tokens=20)
    hits_before = fake.stats()["prefix_cache_hit_tokens"]
    conv += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "w40 w41"},
    ]
    second = c.chat.completions.create(model="fake", messages=conv, max_tokens=4)
    page = OPTS["page_size"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens - 1) // page * page > 0  # every whole page of turn one
    assert fake.stats()["prefix_cache_hit_tokens"] - hits_before == cached
    assert fake.stats()["prefix_cache_hit_rate"] > 0


def test_metrics_count_http_requests(served):
    st, _ = served
    value = lambda name, **labels: st.server.metrics.registry.get_sample_value(name, labels) or 0  # noqa: E731
    before = (value("jaxserve_requests_total", outcome="length"), value("jaxserve_time_to_first_token_seconds_count"))
    r = _client(st).completions.create(model="fake", prompt="hello", max_tokens=3, stream=False)
    assert r.choices[0].finish_reason == "length"
    after = (value("jaxserve_requests_total", outcome="length"), value("jaxserve_time_to_first_token_seconds_count"))
    assert after == (before[0] + 1, before[1] + 1)


def test_a_model_without_a_template(served):
    st, fake = served
    tok = fake.tokenizer
    template, tok.chat_template = tok.chat_template, None  # as if the checkpoint had none
    try:
        with pytest.raises(openai.BadRequestError) as e:
            _client(st).chat.completions.create(model="fake", messages=CHAT, max_tokens=2)
        assert e.value.body["param"] == "messages" and "no chat template" in e.value.body["message"]
        with pytest.raises(grpc.RpcError) as e:
            Client(st.target, token=TOKEN).complete(CHAT, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in e.value.details()
    finally:
        tok.chat_template = template


def test_a_huge_prompt_does_not_delay_a_running_stream(served, monkeypatch):
    """~1 MB of text over gRPC, then a ~1 MB chat message over HTTP: tokenization and template
    rendering run in the engine client's worker thread, never on the event loop both frontends
    share nor on the engine's thread, so a concurrent stream keeps going.

    The oracle holds each big prompt's tokenization still, inside the real call path, until the
    concurrent stream has delivered 20 more tokens, then lets it finish. Were tokenization on the
    loop or the engine thread, the stream would stop there and the wait run out (60 s)."""
    st, fake = served
    big = ("w5 w6 w7 w8\n" * 90000)[:1_000_000]
    entered, release = threading.Event(), threading.Event()
    tokenize = fake.tokenize

    def held(prompt):
        if len(repr(prompt)) > 500_000:  # the big prompt, as text or inside a Conversation
            entered.set()
            release.wait(60)
        return tokenize(prompt)

    monkeypatch.setattr(fake, "tokenize", held)
    tokens: list[int] = []  # every token the concurrent stream receives
    stop = threading.Event()

    def streams():
        c = Client(st.target, token=TOKEN)
        while not stop.is_set():
            for r in c.generate([5, 6, 7], max_tokens=180, ignore_eos=True):
                tokens.extend(r.token_ids)

    def over_grpc():
        with pytest.raises(grpc.RpcError) as e:  # ~250k tokens: longer than the context
            Client(st.target, token=TOKEN).complete(big, max_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.value.details()

    def over_http():
        with pytest.raises(openai.BadRequestError) as e:
            _client(st).chat.completions.create(model="fake", messages=[{"role": "user", "content": big}])
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
    pool_whole(fake)


def test_drain_finishes_short_streams_and_aborts_long_ones():
    """drain (what SIGTERM does): a request that ends within the grace period ends normally, one
    that does not ends with a final chunk (reason "abort") and [DONE], not a broken stream."""
    fake = FakeEngine(step_seconds=0.04, **OPTS)  # the long one: 180 steps, 7 s; the short one 0.2 s
    st = ServerThread(fake, http_port=0, grace_s=2.0)
    try:
        c = _client(st)
        results: dict[str, list] = {}

        def consume(name, max_tokens):
            stream = c.completions.create(
                model="fake", prompt=[5, 6], max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
            )
            results[name] = list(stream)

        threads = [threading.Thread(target=consume, args=(n, m)) for n, m in (("short", 5), ("long", 180))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(st.server.engine.in_flight) < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
        st.run(st.server.drain())
        for t in threads:
            t.join(30)
        assert results["short"][-1].choices[0].finish_reason == "length"
        assert results["long"][-1].choices[0].finish_reason == "abort"
        text = "".join(x.choices[0].text for x in results["long"])
        assert text == fake.tokenizer.decode(fake.model.tokens([5, 6], len(text.split())))  # a prefix, not garbage
        pool_whole(fake)
    finally:
        st.loop.call_soon_threadsafe(st.loop.stop)
