"""Chat: a conversation rendered into prompt token ids by the checkpoint's own chat template.

The template is the tokenizer's (`chat_template` in `tokenizer_config.json`, or
`chat_template.jinja` beside it), applied by transformers' `apply_chat_template` with
`add_generation_prompt=True`, so the prompt ends where the assistant's reply starts. Control
tokens written in a message's text (say `<|eot_id|>` inside user content) are encoded as plain
text (`sanitize_control_tokens=True`): only the template itself writes control tokens, so a user
cannot forge a turn. A checkpoint without a template is refused with a ValueError naming the
`messages` field; there is no fallback format.

Plain Python over a transformers tokenizer; no jax. The engine core calls it from the
frontends' worker threads (EngineClient.submit), never from their event loops: Jinja rendering
is pure Python and tokenization of a long conversation takes a while.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A prompt given as chat messages ({"role", "content"} dicts), as opposed to text or token ids.
    Build it with `Conversation.of`, which validates what every template needs."""

    messages: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, messages: "Conversation | Seq[Mapping[str, Any]]") -> "Conversation":
        if isinstance(messages, Conversation):
            return messages
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
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: must be a string, got {type(content).__name__}")
            out.append(dict(m))
        return cls(tuple(out))


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
        )
    except TemplateError as e:  # the template's raise_exception, or a message it cannot render
        raise ValueError(f"messages: the chat template refused the conversation: {e}") from None
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("messages: the chat template rendered no tokens")
    return ids
