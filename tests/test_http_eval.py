"""The HTTP API for evaluation harnesses and routers against a real server on 127.0.0.1:
/v1/completions with echo, prompt logprobs (against transformers' float32 logits on the same
checkpoint), prompt lists and token-id prompts; /tokenize and /detokenize; vLLM's metric
names on the serving port's /metrics, read while requests run."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch
import transformers
from conftest import TEST_MODEL, make_hf_model, pool_whole
from servers import ServerThread

from jaxserve import LLM, SamplingParams

# max_prefill_chunk is the largest bucket (32): LONG is prefilled in 4 chunks.
OPTS = dict(max_slots=4, page_size=8, max_model_len=256, num_pages=160, token_buckets=(16, 32))
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1", "hello"]
LONG = "Once upon a time, in a land far away, there lived a small robot who liked to count. " * 5


@pytest.fixture(scope="module")
def served():
    llm = LLM(TEST_MODEL, **OPTS)
    ids = [llm.tokenizer.encode(t) for t in TEXTS + [LONG]]
    assert len(ids[-1]) > 2 * OPTS["token_buckets"][-1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(TEST_MODEL, dtype=torch.float32)
    with torch.no_grad():  # the oracle: log-softmax of transformers' logits, position i predicting i + 1
        oracle = [torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1).numpy() for p in ids]
    # the offline references, before the server's loop thread takes over stepping the engine
    ref = {
        "prompt_logprobs": llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, n=2)),
        "next": llm.generate([ids[0]], SamplingParams(max_tokens=1, temperature=0))[0],
        "texts": llm.generate(TEXTS[:2], SamplingParams(max_tokens=4, temperature=0)),
    }
    st = ServerThread(llm, http_port=0, max_waiting=64)
    yield st, llm, ids, oracle, ref
    st.stop()


def _client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.base_url + "/v1", api_key="none", max_retries=0)


def _model(st) -> str:
    return st.server.http.model_name


def _post(st, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of a POST, errors included."""
    req = urllib.request.Request(st.base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _prompt_lps(ids: list[int], oracle: np.ndarray) -> np.ndarray:
    return np.array([oracle[i - 1, ids[i]] for i in range(1, len(ids))])


def test_llm_generate_prompt_logprobs_equal_transformers(served):
    _, llm, ids, oracle, ref = served
    outs = ref["prompt_logprobs"]
    for k, p in enumerate(ids):
        for out in outs[2 * k : 2 * k + 2]:  # both completions of a prompt carry its prompt logprobs
            lps = out.prompt_logprobs
            assert len(lps) == len(p) and lps[0] is None
            got = np.array([lps[i][p[i]] for i in range(1, len(p))])
            np.testing.assert_allclose(got, _prompt_lps(p, oracle[k]), atol=1e-4)
            for i in range(1, len(p)):  # the top 3 are the oracle's, and each token's rank too
                top = sorted(lps[i].items(), key=lambda kv: -kv[1])[:3]
                assert {t for t, _ in top} == set(np.argsort(-oracle[k][i - 1])[:3].tolist())
                assert out.prompt_ranks[i] == 1 + int(np.sum(oracle[k][i - 1] > oracle[k][i - 1, p[i]] + 1e-6))


def test_echo_with_max_tokens_0_scores_a_batch_of_token_id_prompts(served):
    st, llm, ids, oracle, _ = served
    r = _client(st).completions.create(model=_model(st), prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert [c.index for c in r.choices] == list(range(len(ids)))
    for c, p, o in zip(r.choices, ids, oracle):
        lp = c.logprobs
        assert c.text == llm.tokenizer.decode(p) and c.finish_reason == "length"
        assert len(lp.tokens) == len(p) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], _prompt_lps(p, o), atol=1e-4)
        for i in range(1, len(p)):  # top 1: the oracle's most likely token, then the prompt token if another
            top = lp.top_logprobs[i]
            (tok, v), *rest = top.items()
            assert tok == llm.tokenizer.decode([int(np.argmax(o[i - 1]))]) and abs(v - o[i - 1].max()) < 1e-4
            assert len(rest) == (p[i] != int(np.argmax(o[i - 1]))) and top[lp.tokens[i]] == lp.token_logprobs[i]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(p))]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 0


def _check_top_logprobs(lp, n: int, start: int = 0) -> int:
    """Each position's top_logprobs (from `start`): the n most likely, most likely first, then
    the position's own token when not among them; its value is token_logprobs'. The count of
    positions whose token lies outside the top n."""
    outside = 0
    for tok, value, top in zip(lp.tokens[start:], lp.token_logprobs[start:], lp.top_logprobs[start:]):
        assert tok in top and top[tok] == value, (tok, value, top)
        assert len(top) in (n, n + 1) and len(top) >= 1, top
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        if len(top) == n + 1:
            assert list(top)[-1] == tok
            outside += 1
    return outside


def test_completion_top_logprobs_include_the_chosen_token(served):
    """OpenAI's legacy completions: up to logprobs + 1 top_logprobs, the sampled (or echoed
    prompt) token among them even when it is not one of the `logprobs` most likely, as vLLM."""
    st, llm, ids, _, _ = served
    c = _client(st)
    ids_ = {"return_tokens_as_token_ids": True}  # names no two tokens share
    kw = dict(model=_model(st), prompt=TEXTS[0], max_tokens=16, temperature=5.0, seed=7, extra_body=ids_)
    outside = 0
    for n in (0, 2):
        r = c.completions.create(logprobs=n, **kw)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == r.usage.completion_tokens > 0
        outside += _check_top_logprobs(lp, n)
        if n == 0:  # just the sampled token
            assert all(top == {t: v} for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
        chunks = list(c.completions.create(logprobs=n, stream=True, **kw))
        for x in chunks:
            if x.choices and x.choices[0].logprobs is not None:
                _check_top_logprobs(x.choices[0].logprobs, n)
        # echoed prompt positions alike, the prompt token in the place of the sampled one
        r = c.completions.create(logprobs=n, echo=True, **{**kw, "prompt": ids[0]})
        lp = r.choices[0].logprobs
        assert lp.top_logprobs[0] is None and len(lp.tokens) == len(ids[0]) + r.usage.completion_tokens
        assert lp.tokens[: len(ids[0])] == [f"token_id:{t}" for t in ids[0]]
        outside += _check_top_logprobs(lp, n, start=1)
    assert outside > 0  # hot sampling and real text on a random model: the chosen token is often not the top
    pool_whole(llm)


def test_echo_with_max_tokens_1_is_lm_evals_loglikelihood_request(served):
    """What lm-eval's local-completions sends: echo, logprobs=1, max_tokens=1, greedy."""
    st, llm, ids, oracle, ref = served
    p, o = ids[0], oracle[0]
    r = _client(st).completions.create(
        model=_model(st), prompt=p, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    c = r.choices[0]
    assert len(c.logprobs.token_logprobs) == len(p) + 1
    np.testing.assert_allclose(c.logprobs.token_logprobs[1 : len(p)], _prompt_lps(p, o), atol=1e-4)
    nxt = ref["next"]
    assert c.text == llm.tokenizer.decode(p) + nxt.text and r.usage.completion_tokens == 1
    # streamed: the same text and logprobs, the echo in the first chunk
    chunks = list(
        _client(st).completions.create(
            model=_model(st), prompt=p, echo=True, logprobs=1, max_tokens=1, temperature=0, stream=True
        )
    )
    assert "".join(x.choices[0].text for x in chunks) == c.text
    assert sum((x.choices[0].logprobs.token_logprobs for x in chunks), []) == c.logprobs.token_logprobs
    assert sum((x.choices[0].logprobs.text_offset for x in chunks), []) == c.logprobs.text_offset


def test_prompt_logprobs_are_exact_with_a_cached_prefix_and_chunked_prefill(served):
    """A request asking for prompt logprobs recomputes a prefix the cache holds (cached KV has
    no logits): the same values as with a cold cache, LONG's over 4 prefill chunks."""
    st, llm, ids, oracle, _ = served
    p, o = ids[-1], oracle[-1]
    c = _client(st)
    plain = c.completions.create(model=_model(st), prompt=p, max_tokens=1)  # fills the cache (again)
    again = c.completions.create(model=_model(st), prompt=p, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and plain.usage.prompt_tokens == len(p)
    body = dict(model=_model(st), prompt=p, max_tokens=1, prompt_logprobs=2)
    (_, first), (_, second) = _post(st, "/v1/completions", body), _post(st, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["prompt_logprobs"] == second["choices"][0]["prompt_logprobs"]
    plp = first["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(p)
    got = [plp[i][str(p[i])]["logprob"] for i in range(1, len(p))]
    np.testing.assert_allclose(got, _prompt_lps(p, o), atol=1e-4)
    for i in range(1, len(p)):
        top = sorted((e for e in plp[i].values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["decoded_token"] for e in top] == [llm.tokenizer.decode([int(t)]) for t in np.argsort(-o[i - 1])[:2]]


def test_text_prompt_lists_each_get_their_choices(served):
    st, llm, _, _, ref = served
    r = _client(st).completions.create(model=_model(st), prompt=TEXTS[:2], n=2, max_tokens=4, temperature=0)
    want = ref["texts"]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want[0].text] * 2 + [want[1].text] * 2
    stream = _client(st).completions.create(
        model=_model(st), prompt=TEXTS[:2], max_tokens=4, temperature=0, echo=True, stream=True
    )
    texts = {0: "", 1: ""}
    for x in stream:
        texts[x.choices[0].index] += x.choices[0].text
    assert texts == {i: TEXTS[i] + want[i].text for i in range(2)}


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(prompt_logprobs=99), "prompt_logprobs"),
        (dict(echo=True, logprobs=99, max_tokens=0), "logprobs"),
        (dict(prompt=[]), "prompt"),
    ],
)
def test_bad_eval_fields_are_400s_naming_them(served, body, param):
    st, llm, _, _, _ = served
    status, r = _post(st, "/v1/completions", {"model": _model(st), "prompt": "hello", **body})
    assert status == 400 and r["error"]["param"] == param, r
    pool_whole(llm)


def test_tokenize_round_trips_through_detokenize(served):
    st, llm, _, _, _ = served
    for text in TEXTS:
        r = _post(st, "/tokenize", {"model": _model(st), "prompt": text})[1]
        assert r == {
            "count": len(r["tokens"]),
            "max_model_len": OPTS["max_model_len"],
            "tokens": llm.tokenizer.encode(text),
        }
        bare = _post(st, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
        assert _post(st, "/detokenize", {"model": _model(st), "tokens": bare}) == (200, {"prompt": text})
    messages = [{"role": "user", "content": "hello"}]
    r = _post(st, "/tokenize", {"model": _model(st), "messages": messages})[1]
    assert r["tokens"] == llm.core.render_chat(messages)
    with urllib.request.urlopen(st.base_url + "/tokenizer_info", timeout=10) as r:  # lm-eval's remote tokenizer
        info = json.load(r)
    assert (info["bos_token"], info["eos_token"]) == (llm.tokenizer.bos_token, llm.tokenizer.eos_token)
    assert info["chat_template"] == llm.tokenizer.chat_template
    status, bad = _post(st, "/detokenize", {"model": _model(st), "tokens": [10**6]})
    assert status == 400 and bad["error"]["param"] == "tokens"


def _scrape(st) -> dict[str, float]:
    """/metrics on the serving port: {'name{labels}': value}."""
    with urllib.request.urlopen(st.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _get(m: dict, name: str) -> float:
    """The one sample of a vLLM metric (its model_name label whatever it is)."""
    hits = [v for k, v in m.items() if re.fullmatch(re.escape(name) + r"(\{[^}]*\})?", k)]
    assert len(hits) == 1, (name, hits)
    return hits[0]


def test_vllm_metrics_under_load(served):
    st, llm, ids, _, _ = served
    before = _scrape(st)
    info = [k for k in before if k.startswith("vllm:cache_config_info")]
    assert info == [f'vllm:cache_config_info{{block_size="8",num_gpu_blocks="{llm.allocator.capacity}"}}']
    c = _client(st)
    prompts = [f"request {i} says" for i in range(6)]  # 6 requests on 4 slots: 2 wait
    lens = [len(llm.tokenizer.encode(p)) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(
                c.completions.create, model=_model(st), prompt=p, max_tokens=200, extra_body={"ignore_eos": True}
            )
            for p in prompts
        ]
        seen = None
        deadline = time.monotonic() + 60
        while seen is None and time.monotonic() < deadline:
            m = _scrape(st)
            if _get(m, "vllm:num_requests_running") == 4 and _get(m, "vllm:num_requests_waiting") == 2:
                seen = m
        results = [f.result() for f in futures]
    assert seen is not None, "never saw 4 running and 2 waiting"
    assert 0 < _get(seen, "vllm:kv_cache_usage_perc") <= 1
    pool_whole(llm)
    after = _scrape(st)
    assert _get(after, "vllm:num_requests_running") == 0 and _get(after, "vllm:num_requests_waiting") == 0
    # cached prefixes nobody reads count as free (vLLM's meaning); jaxserve's own gauge counts them
    assert _get(after, "vllm:kv_cache_usage_perc") == 0 and after["jaxserve_kv_pages_used"] > 0
    delta = lambda name: _get(after, name) - _get(before, name)  # noqa: E731
    assert delta("vllm:prompt_tokens_total") == sum(lens)
    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in results) == 6 * 200
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds"):
        assert delta(f"vllm:{h}_count") >= (6 if "inter" not in h else 6 * 199), h
    # the prefix cache's counters, in tokens: a repeated prompt's cached tokens are hits
    again = c.completions.create(model=_model(st), prompt=prompts[0], max_tokens=1)
    hit = again.usage.prompt_tokens_details.cached_tokens
    final = _scrape(st)
    assert hit > 0
    assert _get(final, "vllm:prefix_cache_hits_total") - _get(after, "vllm:prefix_cache_hits_total") == hit
    assert (
        _get(final, "vllm:prefix_cache_queries_total") - _get(after, "vllm:prefix_cache_queries_total") == lens[0] - 1
    )


def test_no_compile_after_warmup(served):
    """Runs last: every request above (scoring prefills included) used warmed-up executables."""
    _, llm, _, _, _ = served
    assert llm.compiles_since_warmup() == 0


def test_echo_of_a_token_id_prompt_without_a_tokenizer_is_a_400_and_submits_nothing(tmp_path):
    """A checkpoint without a tokenizer cannot decode a token-id prompt for echo: the request
    is refused before any prompt is submitted (nothing runs on unread), and serving goes on."""
    make_hf_model("llama", tmp_path)
    llm = LLM(tmp_path, max_slots=2, page_size=8, max_model_len=64, num_pages=32, token_buckets=(16,))
    assert llm.core.tokenizer is None
    st = ServerThread(llm, http_port=0)
    try:
        model = _model(st)
        for prompt in ([5, 6, 7], [[5, 6], [7, 8, 9]]):
            body = dict(model=model, prompt=prompt, echo=True, max_tokens=40, ignore_eos=True)
            status, r = _post(st, "/v1/completions", body)
            assert status == 400 and r["error"]["param"] == "echo" and "tokenizer" in r["error"]["message"], r
            assert st.server.engine.in_flight == []
        pool_whole(llm)
        status, r = _post(st, "/v1/completions", dict(model=model, prompt=[5, 6, 7], max_tokens=2, ignore_eos=True))
        assert status == 200 and r["usage"]["completion_tokens"] == 2, r
        pool_whole(llm)
        assert st.server.engine.in_flight == []
    finally:
        st.stop()
