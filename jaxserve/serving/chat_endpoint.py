"""POST /v1/chat/completions: messages rendered by the model's chat template (tools and
response formats too), answered as one JSON body or streamed as chat.completion.chunk events.

A mixin of HttpFrontend (http_server.py): its methods use the frontend's engine client, metrics,
request mapping (`_sampling`, `_submit`) and logprob helpers."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from jaxserve.engine.chat import Conversation
from jaxserve.engine.client import RequestStream
from jaxserve.engine.tool_calls import ToolRequest, finish_reason
from jaxserve.serving.protocol import APIError, Call, ChatCompletionRequest, engine_error, invalid, usage_body

log = logging.getLogger("jaxserve.http")


class ChatEndpoint:
    """/v1/chat/completions, as methods of HttpFrontend."""

    def _chat_call(self, b: ChatCompletionRequest) -> Call:
        try:
            tools = ToolRequest.of(b.tools, b.tool_choice, b.parallel_tool_calls)
        except ValueError as e:
            raise engine_error(e, {}) from None
        messages = []
        for i, m in enumerate(b.messages):
            content = m.content
            if isinstance(content, list):  # text parts only
                bad = [p.type for p in content if p.type != "text" or p.text is None]
                if bad:
                    raise invalid(f"messages[{i}].content", f"only text content parts are supported, got {bad[0]!r}")
                content = "\n".join(p.text for p in content)
            message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            message.update({k: getattr(m, k) for k in ("tool_calls", "tool_call_id", "name") if getattr(m, k)})
            messages.append(message)
        tc = self.tool_calling
        try:
            prompt = Conversation.of(tc.messages(Conversation.of(messages).messages, tools), tc.template_tools(tools))
            grammar = tc.grammar(tools)
        except ValueError as e:
            raise engine_error(e, {}) from None
        if b.top_logprobs is not None and not b.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (b.top_logprobs or 0) if b.logprobs else None
        max_tokens, max_name = (
            (b.max_completion_tokens, "max_completion_tokens")
            if b.max_completion_tokens is not None
            else (b.max_tokens, "max_tokens")
        )
        renames = {"max_tokens": max_name, "logprobs": "top_logprobs", "prompt": "messages", "grammar": "tool_choice"}
        params = self._sampling(b, max_tokens, self.default_max_tokens, logprobs, renames, grammar)
        include_usage = bool(b.stream and b.stream_options and b.stream_options.include_usage)
        return Call("chat", b, prompt, params, renames, logprobs, include_usage, tools)

    async def _serve_chat(self, call: Call, request: Request):
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="service_unavailable")
        call.id = f"chatcmpl-{uuid.uuid4().hex}"
        call.created = int(time.time())
        stream = await self._submit(call, call.prompt, call.id)
        if call.body.stream:
            return EventSourceResponse(self._events(call, stream), ping=15, sep="\n")
        return await self._until_done_or_gone(self._collect(call, stream), request)

    async def _collect(self, call: Call, stream: RequestStream) -> JSONResponse:
        n = stream.n  # choices, by the outputs' index
        text, lps, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        n_ids = 0
        try:
            async with contextlib.aclosing(self._outputs(stream)) as outputs:
                async for out in outputs:
                    text[out.index].append(out.text)
                    n_ids += len(out.token_ids)
                    lps[out.index] += out.logprobs or []
                    last[out.index] = out
        except Exception as e:
            log.exception("engine error")
            return APIError(500, f"engine error: {e}").response()
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {"index": i, "finish_reason": last[i].finish_reason}
            logprobs = await self._logprobs(call, lps[i]) if call.logprobs is not None else None
            choice["message"] = {"role": "assistant", "content": "".join(text[i])}
            parser = self.tool_calling.parser(call.tools)
            if parser is not None:
                choice["message"] = parser.message("".join(text[i]))
                choice["finish_reason"] = finish_reason(parser, choice["finish_reason"])
            choice["logprobs"] = logprobs
            choices.append(choice)
        return JSONResponse(
            {
                **self._head(call, "chat.completion"),
                "choices": choices,
                "usage": usage_body(len(stream.prompt_token_ids), n_ids, last[0].num_cached_prompt_tokens),
            }
        )

    async def _events(self, call: Call, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks (the first of each choice carries the role), the
        usage chunk if asked for, then [DONE]."""
        head = self._head(call, "chat.completion.chunk")
        extra = {"usage": None} if call.include_usage else {}
        dumps = json.dumps
        for i in range(stream.n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield dumps({**head, "choices": [first], **extra})
        n_out, last = 0, None
        parsers = [self.tool_calling.parser(call.tools) for _ in range(stream.n)]
        try:
            async with contextlib.aclosing(self._outputs(stream)) as outputs:
                async for out in outputs:
                    n_out += len(out.token_ids)
                    last = out
                    if not (out.token_ids or out.text or out.finished):
                        continue  # one chunk per engine output, like gRPC (text may be held back)
                    choice: dict[str, Any] = {"index": out.index}
                    parser = parsers[out.index]
                    if parser is not None:
                        choice["delta"] = parser.delta(out.text, out.finished)
                    else:
                        choice["delta"] = {"content": out.text} if out.text else {}
                    lp = await self._logprobs(call, out.logprobs) if call.logprobs is not None else None
                    choice["logprobs"] = lp
                    choice["finish_reason"] = finish_reason(parser, out.finish_reason)
                    yield dumps({**head, "choices": [choice], **extra})
        except Exception as e:
            log.exception("engine error")
            yield dumps(APIError(500, f"engine error: {e}").body())
            yield "[DONE]"
            return
        if call.include_usage:
            usage = usage_body(len(stream.prompt_token_ids), n_out, last.num_cached_prompt_tokens)
            yield dumps({**head, "choices": [], "usage": usage})
        yield "[DONE]"
