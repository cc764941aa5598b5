"""Tool calling: a request's `tools` and `tool_choice`, the call syntax of each chat-template
family, the grammar that enforces a call, and the incremental parser that turns the model's text
into OpenAI `tool_calls` (vLLM's `tool_parsers`, one table instead of one class per family).

A family is the text a model was trained to write for a call:

- `hermes` (Qwen2.5/3, Hermes 2/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call, text allowed around them;
- `smollm2` (SmolLM2-Instruct): `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`;
- `llama3_json` (Llama 3.1/3.2/3.3): the whole reply is `{"name": ..., "parameters": {...}}` (after
  `<|python_tag|>` or not), several separated by `; `;
- `mistral` (Mistral v0.3 and later): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

The parser reads all four shapes (a JSON object or array of objects after the marker, `arguments`
or `parameters`), so the family matters for what is enforced and how a template that knows no
tools is told about them; it is picked from the chat template's text (the marker it writes) unless
`tool_call_parser` names one. Control-token markers (`[TOOL_CALLS]`, `<|python_tag|>`) are dropped
from the text by detokenization, so a reply that *starts* with the family's JSON is a call too,
when the name is one of the request's tools.

`tool_choice` "required" and a named function are enforced by a Lark grammar (llguidance, through
SamplingParams.grammar) of the family's call syntax, the arguments under each function's JSON
schema, so they always parse and validate; "auto" parses whatever the model writes; "none" parses
nothing and does not show the tools to the template. A template that does not mention `tools`
(the shipped default's, SmolLM2's GGUF template) gets them in a system message in the family's
words, and one that does not mention `tool_calls` gets past calls written into the assistant's text.

Streaming: `ToolCallParser.feed` returns the content and the call deltas a chunk of text makes
final; text that may still start a call is held back, so "auto" never shows half a call as
content. `parse` is the same parser fed once: the streamed deltas reassemble to it exactly.
Plain Python; no jax.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any

# -- families ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """How one template family writes tool calls."""

    name: str
    open: str  # text before a call block ("" for none)
    close: str  # text after it ("" for none)
    bare: str  # a reply may start with this JSON opener and no `open` marker ("" for never)
    args_key: str  # "arguments" or "parameters"
    array: tuple[str, str] | None  # how a block's JSON array of calls opens and closes; None: one call a block
    separator: str  # between calls (between blocks when not array)
    id_chars: int  # tool call ids: 9 alphanumerics for Mistral's template, OpenAI's call_... otherwise
    prompt: str  # the system message for templates that do not render `tools` ({tools}: their JSON)


_HERMES_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "The functions are described within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)
_SMOLLM2_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, say so.\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n"
    "The output MUST strictly adhere to the following format, with no other text:\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)
_LLAMA_PROMPT = (
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}"
)
_MISTRAL_PROMPT = (
    "You have access to the following functions: {tools}\n"
    'To call functions, answer with [TOOL_CALLS][{{"name": function name, "arguments": {{...}}}}, ...] and nothing else.'
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("hermes", "<tool_call>", "</tool_call>", "", "arguments", None, "\n", 0, _HERMES_PROMPT),
        Family("smollm2", "<tool_call>", "</tool_call>", "", "arguments", ("[\n", "\n]"), ",\n", 0, _SMOLLM2_PROMPT),
        Family("llama3_json", "<|python_tag|>", "", "{", "parameters", None, "; ", 0, _LLAMA_PROMPT),
        Family("mistral", "[TOOL_CALLS]", "", "[", "arguments", (" [", "]"), ", ", 9, _MISTRAL_PROMPT),
    )
}
PARSERS = tuple(FAMILIES)


def detect_family(template: str | None) -> Family:
    """The family a chat template writes calls in (the marker in its text); hermes when it shows
    none (the most common syntax, and what the parser reads best without a marker)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FAMILIES["mistral"]
    if "<|python_tag|>" in t or '"parameters": dictionary of argument name' in t:
        return FAMILIES["llama3_json"]
    if "<tool_call>[" in t or "SmolLM" in t:
        return FAMILIES["smollm2"]
    return FAMILIES["hermes"]


# -- requests -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (OpenAI's dicts, validated), what it lets the model do with them
    (`choice`: "auto", "none", "required", or a function's name) and whether several calls may
    come in one reply."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def of(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> "ToolRequest | None":
        """Validate OpenAI's fields; None when the request has no tools (and no tool_choice that
        needs them). ValueError naming the field."""
        if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, str) and not tools):
            if tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice: needs tools")
            return None
        if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
            raise ValueError(f"tools: must be a list of function tools, got {type(tools).__name__}")
        out, names = [], set()
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping) or t.get("type", "function") != "function":
                raise ValueError(f"tools[{i}].type: only function tools are supported")
            fn = t.get("function")
            if not isinstance(fn, Mapping):
                raise ValueError(f"tools[{i}].function: must be an object with a name")
            name = fn.get("name")
            if not isinstance(name, str) or not name or any(c.isspace() for c in name):
                raise ValueError(f"tools[{i}].function.name: must be a non-empty name without spaces, got {name!r}")
            if name in names:
                raise ValueError(f"tools[{i}].function.name: {name!r} is given twice")
            names.add(name)
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, Mapping):
                raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
            clean = {"name": name}  # OpenAI's order, which the templates print
            if fn.get("description") is not None:
                clean["description"] = str(fn["description"])
            clean["parameters"] = dict(params)
            out.append({"type": "function", "function": clean})
        if tool_choice is None:
            choice = "auto"
        elif isinstance(tool_choice, str):
            if tool_choice not in ("auto", "none", "required"):
                raise ValueError(f"tool_choice: must be auto, none, required or a function, got {tool_choice!r}")
            choice = tool_choice
        elif isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
            fn = tool_choice.get("function")
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ValueError("tool_choice.function: must be an object with the tool's name")
            name = fn["name"]
            if name not in names:
                raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
            choice = name
        else:
            raise ValueError("tool_choice: must be auto, none, required or {'type': 'function', 'function': {...}}")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError("parallel_tool_calls: must be a boolean")
        return cls(tuple(out), choice, True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def enforced(self) -> bool:
        """The reply must be calls (required, or a named function)."""
        return self.choice not in ("auto", "none")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI returns it: `arguments` is JSON text (the model's own, as written)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class CallDelta:
    """A streamed piece of a call: the first carries id and name, the rest argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id(family: Family) -> str:
    if family.id_chars:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(family.id_chars))
    return f"call_{secrets.token_hex(12)}"


# -- the parser ---------------------------------------------------------------------------

_WS = " \t\r\n"


class _Incomplete(Exception):
    """The text ends inside the value being scanned."""


class _Malformed(Exception):
    """The text cannot continue into a call at `pos`."""

    def __init__(self, pos: int):
        super().__init__(pos)
        self.pos = pos


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int:
    """s[i] is '"': the index after the closing quote."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c == "\n":
            raise _Malformed(j)
        j += 1
    raise _Incomplete


def _value_end(s: str, i: int) -> int:
    """The index after the JSON value starting at s[i]: brackets and strings matched, not a
    full JSON check (the arguments are the model's text; enforced calls are valid by grammar)."""
    if i >= len(s):
        raise _Incomplete
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        stack, j = [c], i + 1
        while j < len(s):
            c = s[j]
            if c == '"':
                j = _string_end(s, j)
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if "{[".index(stack.pop()) != "}]".index(c):
                    raise _Malformed(j)
                if not stack:
                    return j + 1
            j += 1
        raise _Incomplete
    j = i
    while j < len(s) and (s[j].isalnum() or s[j] in "+-."):
        j += 1
    if j == i:
        raise _Malformed(i)
    if j == len(s):
        raise _Incomplete
    return j


_KEYS = ("name", "arguments", "parameters")


@dataclasses.dataclass
class _Object:
    """One call object as scanned so far: its fields' value spans (end None while incomplete)."""

    start: int
    fields: dict[str, tuple[int, int | None]] = dataclasses.field(default_factory=dict)
    end: int | None = None
    error: int | None = None  # where it stops being a call object


def _scan_object(s: str, i: int) -> _Object:
    """The call object starting at s[i] == '{', as far as the text goes. Every decision depends
    only on the text before the character it is about, so feeding the text in any chunks gives
    the same result as feeding it at once."""
    obj = _Object(i)
    j = i + 1
    while True:
        j = _skip_ws(s, j)
        if j >= len(s):
            return obj
        if s[j] == "}":
            obj.end = j + 1
            return obj
        if obj.fields:
            if s[j] != ",":
                obj.error = j
                return obj
            j = _skip_ws(s, j + 1)
            if j >= len(s):
                return obj
        if s[j] != '"':
            obj.error = j
            return obj
        try:
            k_end = _string_end(s, j)
        except _Incomplete:
            if not obj.fields and not any(k.startswith(s[j + 1 :]) for k in _KEYS):
                obj.error = j
            return obj
        except _Malformed as e:
            obj.error = e.pos
            return obj
        key = json.loads(s[j:k_end])
        if not obj.fields and key not in _KEYS:
            obj.error = j
            return obj
        j = _skip_ws(s, k_end)
        if j >= len(s):
            return obj
        if s[j] != ":":
            obj.error = j
            return obj
        j = _skip_ws(s, j + 1)
        if j >= len(s):
            return obj
        try:
            v_end = _value_end(s, j)
        except _Incomplete:
            obj.fields[key] = (j, None)
            return obj
        except _Malformed as e:
            obj.fields[key] = (j, None)
            obj.error = e.pos
            return obj
        obj.fields[key] = (j, v_end)
        j = v_end


@dataclasses.dataclass
class _Block:
    """A call block from its first character (the marker, or the bare JSON opener)."""

    start: int
    body: int  # after the marker
    bare: bool
    objects: list[_Object] = dataclasses.field(default_factory=list)
    end: int | None = None  # after the block (its close marker included)
    error: int | None = None  # where the text stops being calls


def _scan_block(family: Family, s: str, blk: _Block) -> None:
    """Fill blk.objects/end/error from the text: a JSON object or array of objects after the
    marker, separated by ',' or ';', then the close marker if the family has one."""
    blk.objects, blk.end, blk.error = [], None, None
    j = _skip_ws(s, blk.body)
    if j >= len(s):
        return
    array = s[j] == "["
    if array:
        j += 1
    elif s[j] != "{":
        blk.error = j
        return
    while True:
        j = _skip_ws(s, j)
        if j >= len(s):
            return
        if s[j] == "{":
            obj = _scan_object(s, j)
            blk.objects.append(obj)
            if obj.error is not None:
                blk.error = obj.error
                return
            if obj.end is None:
                return
            j = _skip_ws(s, obj.end)
            if j >= len(s):
                return
            if s[j] in ",;":
                j += 1
                continue
        if array:
            if s[j] != "]":
                blk.error = j
                return
            j += 1
        calls_end, j = j, _skip_ws(s, j)
        if family.close and s.startswith(family.close, j):
            blk.end = j + len(family.close)
        elif family.close and family.close.startswith(s[j:]):
            return  # the close marker may be arriving
        else:
            blk.end = calls_end  # the calls end here (a missing close marker is forgiven)
        return


def _longest_prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclasses.dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)


class ToolCallParser:
    """One reply's incremental parser: feed it text as it is decoded; it returns the content and
    call deltas that text makes final. Deterministic in the text, whatever the chunking:
    `parse(text)` (one feed) equals the reassembled stream."""

    def __init__(self, family: Family, tool_names: Sequence[str] = ()):
        self.family = family
        self.tool_names = frozenset(tool_names)
        self.text = ""
        self.pos = 0  # text before pos is decided
        self.block: _Block | None = None
        self.bare_ok = bool(family.bare)  # nothing but whitespace so far
        self.calls: list[dict] = []  # {"id", "name", "arguments", "sent"} per call so far
        self._block_first = 0  # index of the current block's first call
        self.content = ""

    def feed(self, text: str) -> Delta:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> Delta:
        return self._advance(final=True)

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c["id"], c["name"], c["arguments"]) for c in self.calls]

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    # -- OpenAI's shapes ---------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """A whole reply as OpenAI's chat message: content None when it is only calls."""
        self.feed(text)
        self.finish()
        calls = self.tool_calls()
        content = self.content if self.content.strip() or not calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message

    def delta(self, text: str, finished: bool) -> dict:
        """One streamed chunk's OpenAI delta: the content and call pieces this text makes final
        (text that may start a call is held back until it is known); the rest at the end."""
        d = self.feed(text)
        if finished:
            last = self.finish()
            d.content += last.content
            d.calls += last.calls
        delta: dict[str, Any] = {"content": d.content} if d.content else {}
        merged: list[CallDelta] = []  # one entry per call in a chunk: a header absorbs the text after it
        for c in d.calls:
            if merged and merged[-1].index == c.index and c.name is None:
                merged[-1] = dataclasses.replace(merged[-1], arguments=merged[-1].arguments + c.arguments)
            else:
                merged.append(c)
        if merged:
            delta["tool_calls"] = [c.openai() for c in merged]
        return delta

    # -- internals ------------------------------------------------------------------------
    def _advance(self, final: bool) -> Delta:
        out = Delta()
        s, f = self.text, self.family
        while True:
            if self.block is None:
                if self.bare_ok:  # the reply may still start with a bare call
                    j = _skip_ws(s, self.pos)
                    if j >= len(s) or (f.open.startswith(s[j:]) and not s.startswith(f.open, j)):
                        if not final:
                            return out  # whitespace, or the marker's start: wait
                    elif s[j] == f.bare and not s.startswith(f.open, j):
                        self._emit_content(out, s[self.pos : j])
                        self._start_block(j, j, bare=True)
                        continue
                    self.bare_ok = False
                i = s.find(f.open, self.pos)
                if i >= 0:
                    self._emit_content(out, s[self.pos : i])
                    self._start_block(i, i + len(f.open), bare=False)
                    continue
                hold = 0 if final else _longest_prefix_suffix(s[self.pos :], f.open)
                self._emit_content(out, s[self.pos : len(s) - hold])
                self.pos = len(s) - hold
                return out
            blk = self.block
            _scan_block(f, s, blk)
            self._check_names(blk)
            if len(self.calls) == self._block_first:  # nothing of this block is a call yet
                named = blk.objects and self._name(blk, blk.objects[0]) is not None
                if not named and (blk.error is not None or blk.end is not None or final):
                    # not a call after all: its first character is content; look again after it
                    self.block, self.bare_ok = None, False
                    self._emit_content(out, s[blk.start])
                    self.pos = blk.start + 1
                    continue
            self._emit_calls(out, blk)
            if blk.error is None and blk.end is None and not final:
                return out
            end = blk.error if blk.error is not None else blk.end
            self.pos = len(s) if end is None else end  # None: the text ended inside the block
            self.block, self.bare_ok = None, False

    def _start_block(self, start: int, body: int, bare: bool) -> None:
        self.block = _Block(start, body, bare)
        self._block_first = len(self.calls)
        self.bare_ok = False

    def _name(self, blk: _Block, obj: _Object) -> str | bool | None:
        """The object's function name; None while unknown; False when it has none or a bad one
        (a bare block's names must be the request's tools)."""
        span = obj.fields.get("name")
        if span is None or span[1] is None:
            return False if obj.end is not None else None
        name = _json_or_none(self.text[span[0] : span[1]])
        if not isinstance(name, str) or not name or (blk.bare and name not in self.tool_names):
            return False
        return name

    def _check_names(self, blk: _Block) -> None:
        """The calls end before the first object without a good name."""
        for k, obj in enumerate(blk.objects):
            name = self._name(blk, obj)
            if name is False:
                blk.objects, blk.error, blk.end = blk.objects[:k], obj.start, None
                return
            if name is None:
                return

    def _emit_content(self, out: Delta, text: str) -> None:
        if text:
            out.content += text
            self.content += text
            if text.strip():
                self.bare_ok = False

    def _emit_calls(self, out: Delta, blk: _Block) -> None:
        s = self.text
        limit = blk.error if blk.error is not None else len(s)
        for k, obj in enumerate(blk.objects):
            index = self._block_first + k
            if index == len(self.calls):
                name = self._name(blk, obj)
                if not isinstance(name, str):
                    return
                call = {"id": new_call_id(self.family), "name": name, "arguments": "", "sent": 0}
                self.calls.append(call)
                out.calls.append(CallDelta(index, call["id"], name, ""))
            call = self.calls[index]
            args = obj.fields.get("arguments") or obj.fields.get("parameters")
            if args is None:
                if obj.end is not None and not call["arguments"]:
                    self._emit_args(out, index, "{}")
                continue
            a0, a1 = args
            if s[a0] == '"':  # arguments given as a JSON string: sent whole, decoded
                if a1 is not None and not call["sent"]:
                    value = _json_or_none(s[a0:a1])
                    self._emit_args(out, index, value if isinstance(value, str) else "{}")
                    call["sent"] = a1 - a0
                continue
            stop = a1 if a1 is not None else limit
            if stop > a0 + call["sent"]:
                self._emit_args(out, index, s[a0 + call["sent"] : stop])
                call["sent"] = stop - a0
            if obj.end is None:
                return

    def _emit_args(self, out: Delta, index: int, text: str) -> None:
        self.calls[index]["arguments"] += text
        out.calls.append(CallDelta(index, arguments=text))


def finish_reason(parser: ToolCallParser | None, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when a reply that ended by itself made calls."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.made_calls else reason


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse(family: Family, text: str, tool_names: Sequence[str] = ()) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply: the streaming parser fed once."""
    p = ToolCallParser(family, tool_names)
    p.feed(text)
    p.finish()
    return p.content, p.tool_calls()


# -- grammars and prompts -------------------------------------------------------------------

# The call JSON as the templates write it (json.dumps' separators), with no free whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _closed(schema: Any) -> Any:
    """The schema with every object that does not say otherwise closed to keys it does not name
    (`additionalProperties: false`): what it accepts still validates against the original, and a
    small model cannot invent keys until max_tokens (OpenAI's strict mode asks the same of clients)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k in ("items", "anyOf", "oneOf", "allOf") else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: _closed(v) for k, v in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _call_schema(family: Family, tools: Sequence[dict]) -> dict:
    branches = []
    for t in tools:
        fn = t["function"]
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, family.args_key: _closed(fn["parameters"])},
                "required": ["name", family.args_key],
                "additionalProperties": False,
            }
        )
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {**schema, "x-guidance": _JSON_STYLE}


def _lark_literal(text: str, tokenizer: Any) -> str:
    """A marker in Lark: its token (`<[id]>`) when the tokenizer has it as one added token
    (llguidance only lets such tokens be generated by id), else the quoted text."""
    if tokenizer is not None:
        for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(tok, "content", None) == text:
                return f"<[{int(tid)}]>"
    return json.dumps(text)


def grammar(family: Family, request: ToolRequest, tokenizer: Any = None) -> str:
    """The Lark grammar of a reply that is only calls, in the family's syntax: one call of the
    named function, or (required) one or more calls (exactly one without parallel_tool_calls)
    of any of the tools, each one's arguments under its JSON schema."""
    tools = [t for t in request.tools if request.choice in ("required", t["function"]["name"])]
    call = f"%json {json.dumps(_call_schema(family, tools))}"
    many = request.choice == "required" and request.parallel
    sep = json.dumps(family.separator)
    if family.array:
        a_open, a_close = (json.dumps(a) for a in family.array)
        body = f"{a_open} call ({sep} call)* {a_close}" if many else f"{a_open} call {a_close}"
        start = f"{_lark_literal(family.open, tokenizer)} {body}"
        if family.close:
            start += f" {_lark_literal(family.close, tokenizer)}"
    elif family.close:  # hermes: one block per call
        block = f'{_lark_literal(family.open, tokenizer)} "\\n" call "\\n" {_lark_literal(family.close, tokenizer)}'
        start = f'{block} ("\\n" {block})*' if many else block
    else:  # llama3_json: the bare JSON
        start = f"call ({sep} call)*" if many else "call"
    return f"start: {start}\ncall: {call}\n"


def system_prompt(family: Family, request: ToolRequest) -> str:
    """The tools described in the family's words, for a template that does not render `tools`."""
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in request.tools)
    return family.prompt.format(tools=tools)


def call_text(family: Family, calls: Sequence[Mapping]) -> str:
    """Past calls (OpenAI's tool_calls, arguments parsed) as the family writes them: the
    assistant's text for a template that does not render `tool_calls`."""
    objs = [
        json.dumps({"name": c["function"]["name"], family.args_key: c["function"]["arguments"]}, ensure_ascii=False)
        for c in calls
    ]
    if family.array:
        a_open, a_close = family.array
        return f"{family.open}{a_open}{family.separator.join(objs)}{a_close}{family.close}"
    if family.close:
        return "\n".join(f"{family.open}\n{o}\n{family.close}" for o in objs)
    return family.separator.join(objs)


# -- one engine's tool calling ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """Tool calling for one checkpoint: its family, and what its chat template renders itself."""

    family: Family
    tokenizer: Any = None
    renders_tools: bool = True  # the template reads `tools`
    renders_calls: bool = True  # the template reads `tool_calls`

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, parser: str | None = None) -> "ToolCalling":
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default") or next(iter(template.values()), "")
        if parser is not None and parser not in FAMILIES:
            raise ValueError(f"tool_call_parser: must be one of {', '.join(PARSERS)}, got {parser!r}")
        family = FAMILIES[parser] if parser else detect_family(template)
        return cls(family, tokenizer, "tools" in template, "tool_calls" in template)

    def messages(self, messages: Sequence[dict], request: ToolRequest | None) -> list[dict]:
        """The conversation for the template: the tools described in a system message when the
        template ignores `tools`, past calls written as text when it ignores `tool_calls`."""
        out = [dict(m) for m in messages]
        if not self.renders_calls:
            for m in out:
                if m.get("role") == "assistant" and m.get("tool_calls"):
                    text = call_text(self.family, m.pop("tool_calls"))
                    m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        if request is not None and request.choice != "none" and not self.renders_tools:
            prompt = system_prompt(self.family, request)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def template_tools(self, request: ToolRequest | None) -> tuple[dict, ...] | None:
        """The `tools` the template renders (none for tool_choice "none")."""
        if request is None or request.choice == "none" or not self.renders_tools:
            return None
        return request.tools

    def grammar(self, request: ToolRequest | None) -> str | None:
        """The Lark grammar enforcing the calls (required, a named function), else None."""
        if request is None or not request.enforced:
            return None
        return grammar(self.family, request, self.tokenizer)

    def parser(self, request: ToolRequest | None) -> ToolCallParser | None:
        if request is None or request.choice == "none":
            return None
        return ToolCallParser(self.family, request.names)
