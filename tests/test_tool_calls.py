"""Tool calling (jaxserve/engine/tool_calls.py): each family's parser on the exact text the
checkpoints' own chat templates write for an assistant's tool_calls (tests/data/chat/, rendered
by transformers' apply_chat_template), streaming reassembly equal to the one-shot parse at every
split point, the enforcing grammar accepting the templates' text and refusing schema-invalid
arguments (llguidance over the family's tokenizer), the request's validation, and the
conversation rendered back (tool results, past calls) as transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from conftest import TEST_MODEL
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.structured import Grammars
from jaxserve.engine.tokenizer import load_tokenizer
from jaxserve.engine.tool_calls import (
    FAMILIES,
    ToolCalling,
    ToolCallParser,
    ToolRequest,
    call_text,
    detect_family,
    parse,
)

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "data" / "chat"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
NAMES = ("get_weather", "get_time")
CALLS = [
    {
        "id": "call00001",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    },
    {"id": "call00002", "type": "function", "function": {"name": "get_time", "arguments": {}}},
]
# (template directory, family the template is detected as, calls its template can write at once)
TEMPLATES = [("qwen2.5", "hermes", 2), ("llama-3.1", "llama3_json", 1), ("mistral-v0.3", "mistral", 2)]


def _theirs(name: str):
    return AutoTokenizer.from_pretrained(str(DATA / name))


def _assistant_text(tok, calls) -> str:
    """The assistant turn the template writes for these calls, without its end-of-turn token."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    before = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    after = tok.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": calls}], tools=TOOLS, tokenize=False
    )
    assert after.startswith(before)
    text = after[len(before) :]
    for end in ("<|im_end|>\n", "<|eot_id|>", "</s>"):
        text = text.removesuffix(end)
    return text


def _family_texts() -> dict[str, str]:
    """Each family's exact call text: from the checkpoints' templates, SmolLM2's written by
    call_text (its GGUF template renders no tools; the format is its model card's)."""
    out = {}
    for name, fam, n in TEMPLATES:
        out[fam] = _assistant_text(_theirs(name), CALLS[:n])
    out["smollm2"] = call_text(FAMILIES["smollm2"], CALLS)
    return out


TEXTS = _family_texts()


def test_template_texts_are_the_families_syntax():
    """What the templates write (the oracle the parser is held to), spelled out once."""
    assert TEXTS["hermes"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert TEXTS["llama3_json"] == '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    assert TEXTS["mistral"].startswith(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}'
    )
    assert TEXTS["smollm2"] == (
        '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},\n'
        '{"name": "get_time", "arguments": {}}\n]</tool_call>'
    )


@pytest.mark.parametrize("name, family, n", TEMPLATES)
def test_the_family_is_detected_from_the_template(name, family, n):
    tok = load_tokenizer(DATA / name)
    assert detect_family(tok.chat_template).name == family
    assert ToolCalling.for_tokenizer(tok, "smollm2").family.name == "smollm2"  # the option wins
    with pytest.raises(ValueError, match="^tool_call_parser: must be one of"):
        ToolCalling.for_tokenizer(tok, "pythonic")


@pytest.mark.parametrize("family", sorted(TEXTS))
def test_each_family_parses_its_templates_text(family):
    n = 1 if family == "llama3_json" else 2
    content, calls = parse(FAMILIES[family], TEXTS[family], NAMES)
    assert content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CALLS[:n]
    ]
    assert len({c.id for c in calls}) == n
    # the Mistral control token is dropped by detokenization: its bare JSON parses the same
    if family == "mistral":
        bare = TEXTS[family].removeprefix("[TOOL_CALLS]")
        assert [(c.name, c.arguments) for c in parse(FAMILIES[family], bare, NAMES)[1]] == [
            (c.name, c.arguments) for c in calls
        ]
        assert len(calls[0].id) == 9 and calls[0].id.isalnum()  # what Mistral's template requires back


# Replies that are text around calls, or that look like calls and are not.
MIXED = {
    "hermes": [
        "Let me check.\n" + TEXTS["hermes"] + "\nDone.",
        "a < b and <tool_c is not a tag",
        '<tool_call>\n{"nome": 1}\n</tool_call> was not a call',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut at max_tokens
        '<tool_call>\n{"na',  # cut before the name: text
        '<tool_call>\n{"arguments": {"days": 2}, "name": "get_weather"}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>',
    ],
    "llama3_json": [
        '  <|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"days": 1}}',
        '{"name": "Bob", "age": 3}',  # JSON that is not a call of one of the tools: content
        '{"answer": 42}',
        "The answer is 42.",
    ],
    "mistral": [
        "[1, 2] is a list",
        '[{"name": "get_time", "arguments": {}}] trailing',
        "[TOOL_CALLS] nothing",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
    ],
    "smollm2": ["Sure: " + TEXTS["smollm2"], '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'],
}
CASES = [(f, t) for f, texts in MIXED.items() for t in texts] + [(f, t) for f, t in TEXTS.items()]


def _stream(family: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed text in the chunks cuts make; reassemble content and calls from the deltas, as an
    OpenAI client does (id and name from a call's first delta, arguments concatenated)."""
    p = ToolCallParser(FAMILIES[family], NAMES)
    content, calls = "", {}
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    for d in deltas:
        content += d.content
        for c in d.calls:
            if c.name is not None:
                assert c.index not in calls and c.index == len(calls)  # each call's header once, in order
                calls[c.index] = [c.id, c.name, ""]
            calls[c.index][2] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _one_shot(family: str, text: str):
    p = ToolCallParser(FAMILIES[family], NAMES)
    p.feed(text)
    p.finish()
    return p.content, [(c.name, c.arguments) for c in p.tool_calls()]


@pytest.mark.parametrize("family, text", CASES)
def test_streaming_at_every_split_point_reassembles_to_the_parse(family, text):
    want = _one_shot(family, text)
    for i in range(len(text) + 1):
        content, calls = _stream(family, text, [i])
        assert (content, [c[1:] for c in calls]) == want, i
    content, calls = _stream(family, text, list(range(len(text))))  # one character at a time
    assert (content, [c[1:] for c in calls]) == want


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.floats(0, 1), max_size=8))
def test_streaming_under_random_chunkings_reassembles_to_the_parse(case, fractions):
    family, text = case
    content, calls = _stream(family, text, [int(f * len(text)) for f in fractions])
    assert (content, [c[1:] for c in calls]) == _one_shot(family, text)


def test_what_is_and_is_not_a_call():
    h, ll, m = FAMILIES["hermes"], FAMILIES["llama3_json"], FAMILIES["mistral"]
    content, calls = parse(h, MIXED["hermes"][0], NAMES)
    assert content == "Let me check.\n\n\nDone." and [c.name for c in calls] == list(NAMES)
    assert parse(h, MIXED["hermes"][2], NAMES) == (MIXED["hermes"][2], [])
    cut = parse(h, MIXED["hermes"][3], NAMES)  # a call cut by max_tokens keeps what it had
    assert cut[0] == "" and (cut[1][0].name, cut[1][0].arguments) == ("get_weather", '{"city": "Pa')
    assert parse(h, MIXED["hermes"][4], NAMES) == (MIXED["hermes"][4], [])
    assert parse(h, MIXED["hermes"][5], NAMES)[1][0].arguments == '{"days": 2}'  # arguments before name
    assert parse(h, MIXED["hermes"][6], NAMES)[1][0].arguments == '{"tz": "UTC"}'  # arguments as a string
    two = parse(ll, MIXED["llama3_json"][0], NAMES)[1]
    assert [(c.name, c.arguments) for c in two] == [("get_time", "{}"), ("get_weather", '{"days": 1}')]
    for text in MIXED["llama3_json"][1:]:
        assert parse(ll, text, NAMES) == (text, [])
    assert parse(m, "[1, 2] is a list", NAMES) == ("[1, 2] is a list", [])
    assert parse(m, MIXED["mistral"][1], NAMES)[0] == " trailing"


def _accepts(grammars: Grammars, lark: str, tok, text: str) -> bool:
    state = grammars.state(type("P", (), {"constraint": ("grammar", lark)})())
    ids = tok.encode(text, add_special_tokens=False)
    for t in ids:
        if state.done:  # the grammar is complete: no more tokens allowed
            return False
        state.accept(t)
    return not state.failed and state.matcher.is_accepting()


@pytest.mark.parametrize("name, family, n", TEMPLATES)
def test_the_grammar_accepts_the_templates_call_and_refuses_bad_arguments(name, family, n):
    tok = load_tokenizer(DATA / name)
    tc = ToolCalling.for_tokenizer(tok)
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    named = ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    text = _assistant_text(_theirs(name), CALLS[:1])
    if family == "mistral":  # its template adds the call id to the JSON; the grammar has no room for it
        text = call_text(FAMILIES["mistral"], CALLS[:1])
    assert _accepts(grammars, tc.grammar(named), tok, text)
    for bad in ('"Paris"', '"Rome"'):
        assert not _accepts(grammars, tc.grammar(named), tok, text.replace('"Paris"', bad).replace("3", "9"))
    required = ToolRequest.of(TOOLS, "required", True)
    if n == 2:
        two = TEXTS[family] if family != "mistral" else call_text(FAMILIES["mistral"], CALLS)
        assert _accepts(grammars, tc.grammar(required), tok, two)
        single = ToolRequest.of(TOOLS, "required", False)
        assert not _accepts(grammars, tc.grammar(single), tok, two)
    assert tc.grammar(ToolRequest.of(TOOLS, "auto")) is None and tc.grammar(ToolRequest.of(TOOLS, "none")) is None


def test_the_grammar_closes_open_objects_and_still_validates():
    tok = load_tokenizer(DATA / "qwen2.5")
    tc = ToolCalling.for_tokenizer(tok)
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    nested = {"type": "object", "properties": {"opts": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    req = ToolRequest.of([{"type": "function", "function": {"name": "f", "parameters": nested}}], "required")
    ok = '<tool_call>\n{"name": "f", "arguments": {"opts": {"x": 1}}}\n</tool_call>'
    assert _accepts(grammars, tc.grammar(req), tok, ok)
    jsonschema.validate({"opts": {"x": 1}}, nested)
    for extra in ('{"opts": {"x": 1, "y": 2}}', '{"opts": {"x": 1}, "z": 0}'):
        jsonschema.validate(json.loads(extra), nested)  # the schema allows it; the grammar does not
        assert not _accepts(grammars, tc.grammar(req), tok, ok.replace('{"opts": {"x": 1}}', extra))


def test_smollm2_grammar_accepts_its_format():
    tok = load_tokenizer(DATA / "qwen2.5")  # a ChatML tokenizer with <tool_call> tokens, as SmolLM2's text needs
    tc = ToolCalling.for_tokenizer(tok, "smollm2")
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    assert _accepts(grammars, tc.grammar(ToolRequest.of(TOOLS, "required")), tok, TEXTS["smollm2"])
    content, calls = parse(FAMILIES["smollm2"], TEXTS["smollm2"], NAMES)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


@pytest.mark.parametrize(
    "tools, choice, parallel, match",
    [
        ("f", None, None, r"^tools: must be a list"),
        ([{"type": "retrieval"}], None, None, r"^tools\[0\]\.type: only function tools"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, r"^tools\[0\]\.function\.name"),
        ([TOOLS[0], TOOLS[0]], None, None, r"^tools\[1\]\.function\.name: 'get_weather' is given twice"),
        (TOOLS, "sometimes", None, r"^tool_choice: must be"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, r"^tool_choice\.function\.name"),
        (TOOLS, {"type": "function", "function": "get_weather"}, None, r"^tool_choice\.function: must be an object"),
        (TOOLS, {"type": "function", "function": {"name": ["get_weather"]}}, None, r"^tool_choice\.function: "),
        (TOOLS, None, "yes", r"^parallel_tool_calls: must be a boolean"),
        (None, "required", None, r"^tool_choice: needs tools"),
    ],
)
def test_request_validation_names_the_field(tools, choice, parallel, match):
    with pytest.raises(ValueError, match=match):
        ToolRequest.of(tools, choice, parallel)


def test_request_fields():
    assert ToolRequest.of(None) is None and ToolRequest.of([], "none") is None
    r = ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (r.choice, r.parallel, r.enforced, r.names) == ("get_time", False, True, NAMES)
    assert ToolRequest.of(TOOLS).choice == "auto" and not ToolRequest.of(TOOLS).enforced


HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call00001",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00001", "content": '{"forecast": "sunny"}'},
]


@pytest.mark.parametrize("name", [t[0] for t in TEMPLATES])
def test_tool_results_and_past_calls_render_as_transformers_renders_them(name):
    """OpenAI's history (arguments as JSON text) renders as transformers renders the same
    conversation with arguments as a dict, the tools included."""
    ours, theirs = load_tokenizer(DATA / name), _theirs(name)
    tc = ToolCalling.for_tokenizer(ours)
    request = ToolRequest.of(TOOLS)
    conv = Conversation.of(tc.messages(Conversation.of(HISTORY).messages, request), tc.template_tools(request))
    as_dicts = [dict(m) for m in HISTORY]
    as_dicts[1] = {**as_dicts[1], "content": "", "tool_calls": CALLS[:1]}
    want = theirs.apply_chat_template(
        as_dicts, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert render(ours, conv) == list(want)
    text = theirs.decode(render(ours, conv))
    assert "sunny" in text and "get_weather" in text and '"days": 3' in text
    none = ToolRequest.of(TOOLS, "none")  # tool_choice none: the template is not shown the tools
    assert tc.template_tools(none) is None and tc.parser(none) is None


def test_a_template_without_tools_gets_them_in_a_system_message():
    """The shipped default's template knows neither tools nor tool_calls: the tools are described
    in the family's words, and past calls are written into the assistant's text."""
    tok = load_tokenizer(TEST_MODEL)
    tc = ToolCalling.for_tokenizer(tok)
    assert (tc.family.name, tc.renders_tools, tc.renders_calls) == ("hermes", False, False)
    msgs = tc.messages(Conversation.of(HISTORY).messages, ToolRequest.of(TOOLS))
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == call_text(FAMILIES["hermes"], Conversation.of(HISTORY).messages[1]["tool_calls"])
    assert "tool_calls" not in msgs[2]
    text = tok.decode(render(tok, Conversation.of(msgs)))
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in text
    assert tc.messages(HISTORY[:1], ToolRequest.of(TOOLS, "none")) == HISTORY[:1]


def test_conversation_validation_of_calls_names_the_field():
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        Conversation.of(bad)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function"):
        Conversation.of([HISTORY[0], {**HISTORY[1], "tool_calls": [{"type": "function"}]}])


def test_the_parser_option_is_checked_where_it_is_configured():
    from jaxserve.engine.engine_config import EngineConfig
    from jaxserve.serve_config import ServeConfig

    assert EngineConfig(tool_call_parser="mistral").tool_call_parser == "mistral"
    assert ServeConfig(tool_call_parser="hermes").engine_config().tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="^tool_call_parser must be one of hermes, smollm2, llama3_json, mistral"):
        EngineConfig(tool_call_parser="pythonic")
