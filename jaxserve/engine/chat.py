"""Chat: a conversation rendered into prompt token ids by the checkpoint's own chat template.

The template is the tokenizer's (`chat_template` in `tokenizer_config.json`, or
`chat_template.jinja` beside it), applied by transformers' `apply_chat_template` with
`add_generation_prompt=True`, so the prompt ends where the assistant's reply starts. Control
tokens written in a message's text (say `<|eot_id|>` inside user content) are encoded as plain
text (`sanitize_control_tokens=True`): only the template itself writes control tokens, so a user
cannot forge a turn. A checkpoint without a template is refused with a ValueError naming the
`messages` field; there is no fallback format.

Tool calling (engine/tool_calls.py) adds the request's `tools` (the template's `tools` variable),
assistant messages with `tool_calls` (content may then be empty) and `tool` messages answering
them; a call's `arguments`, JSON text in OpenAI's API, reach the template as a dict, as
transformers' templates expect.

Plain Python over a transformers tokenizer; no jax. The engine core calls it from the
frontends' worker threads (EngineClient.submit), never from their event loops: Jinja rendering
is pure Python and tokenization of a long conversation takes a while.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A prompt given as chat messages ({"role", "content"} dicts), as opposed to text or token ids.
    Build it with `Conversation.of`, which validates what every template needs."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None  # OpenAI function tools, for the template

    @classmethod
    def of(
        cls, messages: "Conversation | Seq[Mapping[str, Any]]", tools: Seq[Mapping[str, Any]] | None = None
    ) -> "Conversation":
        if isinstance(messages, Conversation):
            return messages if tools is None else dataclasses.replace(messages, tools=tuple(tools) or None)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Seq):
            raise ValueError(f"messages: must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages: must not be empty")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ValueError(f"messages[{i}]: must be a {{'role', 'content'}} dict, got {type(m).__name__}")
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {role!r}")
            m = dict(m)
            if role == "assistant" and m.get("tool_calls"):
                m["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
                if content is None:
                    m["content"] = content = ""
            elif "tool_calls" in m:
                del m["tool_calls"]  # None or [] (OpenAI clients send them): as if absent
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: must be a string, got {type(content).__name__}")
            out.append(m)
        return cls(tuple(out), tuple(tools) if tools else None)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's calls as templates read them: arguments decoded to a dict."""
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Seq):
        raise ValueError(f"{where}: must be a list of calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{j}].function: must be an object with a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"{where}[{j}].function.arguments: not valid JSON") from None
        out.append({**c, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def is_conversation(obj: Any) -> bool:
    """One conversation (a non-empty list of message dicts), as opposed to a list of them."""
    return isinstance(obj, Conversation) or (
        isinstance(obj, Seq) and not isinstance(obj, str) and bool(obj) and isinstance(obj[0], Mapping)
    )


def render(tokenizer: Any | None, conversation: Conversation, where: object = "the model") -> list[int]:
    """Prompt token ids of a conversation, ending with the template's generation prompt.
    ValueError naming `messages` when there is no template or the template refuses it."""
    if tokenizer is None:
        raise ValueError(f"messages: {where} has no tokenizer, so no chat template; send token_ids instead")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"messages: {where} has no chat template (no 'chat_template' in tokenizer_config.json and no "
            "chat_template.jinja); send text or token_ids instead"
        )
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(
            list(conversation.messages),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
            tools=list(conversation.tools) if conversation.tools else None,
        )
    except TemplateError as e:  # the template's raise_exception, or a message it cannot render
        raise ValueError(f"messages: the chat template refused the conversation: {e}") from None
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("messages: the chat template rendered no tokens")
    return ids
