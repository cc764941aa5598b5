"""Tool calling through the OpenAI-compatible HTTP API on the jitted engine, end to end: a named
or required call is schema-valid and equals LLM.chat's, streamed or not; a tool result turn is
answered; tool_choice none and auto; bad tool fields are a 400 naming them. The parsers, grammars
and templates themselves are tests/test_tool_calls.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import pool_whole as _pool_whole
from servers import ServerThread
from test_tool_calls import HISTORY

# -- the server: the official openai client against a real server on 127.0.0.1 --------------
# The conftest's tiny llama (random weights: it never calls a tool by itself, so "auto" is
# tested on the parsers in test_tool_calls.py) with a compact hermes-style template that renders
# tools, past calls and tool results itself, naming the tools only (the real templates' tool
# prompts overflow the tiny model's 512 positions at its ~1 character a token).
COMPACT = """{%- if tools %}<|im_start|>system
Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role + '\n' }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
SMALL = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
SERVER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SMALL}},
    # open to any key, as clients write it: the grammar closes it (else a random model's keys run to max_tokens)
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
SERVE_OPTS = dict(max_slots=4, page_size=8, max_model_len=384, num_pages=200, token_buckets=(32, 128))
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_KW = dict(max_tokens=100, temperature=0.0)
SMALL_HISTORY = [
    ASK[0],
    {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "id": "c1"}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tool_server(tok_model, tmp_path_factory):
    import shutil

    from jaxserve import LLM, SamplingParams

    d = tmp_path_factory.mktemp("llama_tools")
    for f in tok_model[0].iterdir():
        shutil.copy(f, d)
    (d / "chat_template.jinja").write_text(COMPACT)
    llm = LLM(d, **SERVE_OPTS)
    sp = SamplingParams(**CALL_KW)
    ref = {
        "named": llm.chat(ASK, sp, tools=SERVER_TOOLS, tool_choice=NAMED)[0],
        "result": llm.chat(SMALL_HISTORY, sp, tools=SERVER_TOOLS)[0],
        "plain": llm.chat(ASK, sp)[0],
        "auto": llm.chat(ASK, sp, tools=SERVER_TOOLS)[0],
    }
    st = ServerThread(llm, http_port=0, max_waiting=16)
    yield st, llm, ref
    st.stop()


def _openai(st):
    import openai

    return openai.OpenAI(base_url=st.base_url + "/v1", api_key="none", max_retries=0)


def _create(st, **kw):
    return _openai(st).chat.completions.create(model=st.server.http.model_name, **{**CALL_KW, **kw})


def _reassemble(chunks) -> tuple[str, list[tuple[str, str, str]], str | None]:
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_named_call_is_schema_valid_equals_llm_chat_and_streams_the_same(tool_server):
    st, llm, ref = tool_server
    r = _create(st, messages=ASK, tools=SERVER_TOOLS, tool_choice=NAMED)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SMALL)
    want = ref["named"]  # the offline API on the same engine, before it served
    assert [(c.name, c.arguments) for c in want.tool_calls] == [(call.function.name, call.function.arguments)]
    assert want.text == ""
    chunks = list(_create(st, messages=ASK, tools=SERVER_TOOLS, tool_choice=NAMED, stream=True))
    content, calls, finish = _reassemble(chunks)
    assert content == "" and finish == "tool_calls"
    assert [c[1:] for c in calls] == [(call.function.name, call.function.arguments)]
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) > 2  # arguments came in pieces
    _pool_whole(llm)
    assert llm.compiles_since_warmup() == 0


def test_required_gives_one_schema_valid_call_of_a_tool(tool_server):
    st, llm, _ = tool_server
    r = _create(
        st, messages=ASK, tools=SERVER_TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", r.model_dump_json()
    (call,) = ch.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in SERVER_TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed = _reassemble(
        _create(
            st,
            messages=ASK,
            tools=SERVER_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=3,
            stream=True,
        )
    )
    assert [c[1:] for c in streamed[1]] == [(call.function.name, call.function.arguments)]


def test_a_tool_result_turn_is_answered(tool_server):
    st, llm, ref = tool_server
    r = _create(st, messages=SMALL_HISTORY, tools=SERVER_TOOLS)
    ch = r.choices[0]
    want = ref["result"]
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert ch.message.content == want.text and ch.finish_reason == want.finish_reason
    assert not ch.message.tool_calls and not want.tool_calls
    # the client's own reply object sent back, as agents do, with the tool's result
    call = _create(st, messages=ASK, tools=SERVER_TOOLS, tool_choice=NAMED).choices[0].message
    result = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny"}
    again = _create(st, messages=[*ASK, call, result], tools=SERVER_TOOLS, max_tokens=4)
    assert again.choices[0].message.content is not None


def test_tool_choice_none_returns_content(tool_server):
    st, llm, ref = tool_server
    r = _create(st, messages=ASK, tools=SERVER_TOOLS, tool_choice="none")
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.finish_reason in ("stop", "length")
    assert ch.message.content == ref["plain"].text  # tools are neither shown nor parsed


def test_auto_passes_a_reply_without_calls_through_whole_streamed_or_not(tool_server):
    st, llm, ref = tool_server
    want = ref["auto"]
    assert not want.tool_calls  # random weights: no call
    r = _create(st, messages=ASK, tools=SERVER_TOOLS)
    assert r.choices[0].message.content == want.text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == want.finish_reason
    content, calls, finish = _reassemble(_create(st, messages=ASK, tools=SERVER_TOOLS, stream=True))
    assert (content, calls, finish) == (want.text, [], want.finish_reason)


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        (dict(tools=SERVER_TOOLS, tool_choice="sometimes"), "tool_choice"),
        (
            dict(tools=SERVER_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name",
        ),
        (dict(tools=SERVER_TOOLS, tool_choice={"type": "function", "function": "f"}), "tool_choice.function"),
        (dict(tools=SERVER_TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (
            dict(
                messages=[*HISTORY[:1], {**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
            ),
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(tool_server, kw, param):
    import openai

    st, llm, _ = tool_server
    with pytest.raises(openai.BadRequestError) as e:
        _create(st, **{"messages": ASK, **kw})
    assert e.value.body["param"] == param, e.value.body
    assert _create(st, messages=ASK, max_tokens=2).choices[0].message.content is not None
