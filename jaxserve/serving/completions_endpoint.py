"""POST /v1/completions: a prompt (text or token ids) or a list of them, each its own engine
request with n choices; echo, logprobs with text offsets and vLLM's prompt_logprobs (the engine
scores the prompt in its prefill), answered as one JSON body or streamed as text_completion events.

A mixin of HttpFrontend (http_server.py): its methods use the frontend's engine client, metrics,
request mapping (`_sampling`, `_submit`) and logprob helpers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from jaxserve.engine.client import RequestStream, TokenLogprob, split_logprobs
from jaxserve.engine.request import RequestOutput
from jaxserve.serving.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    APIError,
    Call,
    CompletionChoice,
    CompletionRequest,
    engine_error,
    invalid,
    usage_body,
)

log = logging.getLogger("jaxserve.http")


class CompletionsEndpoint:
    """/v1/completions, as methods of HttpFrontend."""

    def _completion_call(self, b: CompletionRequest) -> Call:
        if b.suffix:
            raise invalid("suffix", "suffix is not supported by this server")
        if b.best_of is not None and b.best_of != 1:
            raise invalid("best_of", f"best_of must be 1, got {b.best_of}")
        prompts = (
            b.prompt if isinstance(b.prompt, list) and b.prompt and isinstance(b.prompt[0], (str, list)) else [b.prompt]
        )
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise invalid("prompt", f"prompt: a list of 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        echo = bool(b.echo)
        if b.max_tokens == 0 and not echo:
            raise invalid("max_tokens", "max_tokens must be >= 1 (0 only with echo: the prompt alone)")
        drop = b.max_tokens == 0
        # Echo's logprobs over the prompt and vLLM's prompt_logprobs come from one scoring prefill.
        want = [n for n in (b.logprobs if echo else None, b.prompt_logprobs) if n is not None]
        renames = {"prompt_token_ids": "prompt"}
        if echo and b.logprobs is not None and b.prompt_logprobs is None:
            renames["prompt_logprobs"] = "logprobs"
        base = self._sampling(b, 1 if drop else b.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, b.logprobs, renames)
        params = base if not want else lambda n: dataclasses.replace(base(n), prompt_logprobs=max(want))
        try:
            params(0)
        except ValueError as e:
            raise engine_error(e, renames) from None
        include_usage = bool(b.stream and b.stream_options and b.stream_options.include_usage)
        call = Call("completion", b, prompts[0], params, renames, b.logprobs, include_usage)
        call.prompts, call.echo, call.drop_output, call.prompt_logprobs = prompts, echo, drop, b.prompt_logprobs
        return call

    async def _serve_completion(self, call: Call, request: Request):
        """Each prompt of the list is its own engine request; the choices of prompt p are
        p * n + 0..n-1. A refused prompt aborts the ones already submitted."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="service_unavailable")
        call.id, call.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = await self._echo_texts(call)  # before submitting: a refusal leaves nothing in flight
        streams: list[RequestStream] = []
        try:
            for p, prompt in enumerate(call.prompts):
                streams.append(await self._submit(call, prompt, call.id if p == 0 else f"{call.id}-{p}"))
        except BaseException:
            for st in streams:
                self.engine.abort(st.request_id)
            raise
        if call.body.stream:
            return EventSourceResponse(self._completion_events(call, streams, echo), ping=15, sep="\n")
        return await self._until_done_or_gone(self._completion_collect(call, streams, echo), request)

    async def _echo_texts(self, call: Call) -> list[str]:
        """Each prompt's echo: its text as given, or its token ids decoded (the engine keeps
        token-id prompts as given). A 400 when they cannot be decoded (no tokenizer, an id
        outside the vocabulary); called before any prompt is submitted."""
        if not call.echo:
            return [""] * len(call.prompts)
        loop = asyncio.get_running_loop()
        out = []
        for prompt in call.prompts:
            if isinstance(prompt, str):
                out.append(prompt)
                continue
            if not self.engine.has_tokenizer:
                raise invalid(
                    "echo",
                    f"echo: {self.model_name} has no tokenizer to decode a token-id prompt with; send the request"
                    " without echo",
                )
            try:
                out.append(await loop.run_in_executor(None, self.engine.detokenize, prompt))
            except ValueError as e:
                raise invalid("prompt", str(e).removeprefix("tokens: ")) from None
        return out

    async def _merged(self, call: Call, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every stream as they come; closing it aborts the rest."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, stream: RequestStream) -> None:
            try:
                async with contextlib.aclosing(self._outputs(stream)) as outputs:
                    async for out in outputs:
                        q.put_nowait((p, out))
            except Exception as e:
                q.put_nowait((p, e))
            finally:
                q.put_nowait((p, None))

        tasks = [asyncio.create_task(pump(p, st)) for p, st in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                p, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their cleanup aborts unfinished requests

    def _choice_index(self, streams: list[RequestStream], p: int, out: RequestOutput) -> int:
        return p * streams[0].n + out.index

    def _absorb(self, call: Call, choice: CompletionChoice, out: RequestOutput) -> tuple[str, list, list]:
        """An engine output's share of a choice: (text, output logprobs, echoed prompt part),
        the echoed prompt in the choice's first output only."""
        text, lps = ("", []) if call.drop_output else (out.text, out.logprobs or [])
        prompt_part: list = []
        if out.prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs, choice.prompt_ranks = out.prompt_logprobs, out.prompt_ranks
        if call.echo and not choice.echoed:
            choice.echoed = True
            prompt_part = [
                (t, (choice.prompt_logprobs or [None] * len(out.prompt_token_ids))[i])
                for i, t in enumerate(out.prompt_token_ids)
            ]
        choice.finish_reason = out.finish_reason
        return text, lps, prompt_part

    async def _completion_collect(self, call: Call, streams: list[RequestStream], echo: list[str]) -> JSONResponse:
        n = streams[0].n
        choices = [CompletionChoice(i // n) for i in range(len(streams) * n)]
        parts: list[list] = [[] for _ in choices]  # echoed prompt (token, logprobs) pairs
        last: dict[int, RequestOutput] = {}
        n_out = 0
        try:
            async with contextlib.aclosing(self._merged(call, streams)) as merged:
                async for p, out in merged:
                    i = self._choice_index(streams, p, out)
                    text, lps, prompt_part = self._absorb(call, choices[i], out)
                    choices[i].text.append(text)
                    choices[i].logprobs += lps
                    parts[i] += prompt_part
                    n_out += 0 if call.drop_output else len(out.token_ids)
                    last[p] = out
        except Exception as e:
            log.exception("engine error")
            return APIError(500, f"engine error: {e}").response()
        body = []
        for i, c in enumerate(choices):
            text = (echo[c.prompt] if call.echo else "") + "".join(c.text)
            entry: dict[str, Any] = {"index": i, "text": text}
            entry["logprobs"] = (
                await self._completion_logprobs(call, parts[i], c.logprobs, 0) if call.logprobs is not None else None
            )
            entry["finish_reason"] = c.finish_reason
            if call.prompt_logprobs is not None:
                entry["prompt_logprobs"] = await self._vllm_prompt_logprobs(call, c)
            body.append(entry)
        n_prompt = sum(len(st.prompt_token_ids) for st in streams)
        cached = sum(out.num_cached_prompt_tokens for out in last.values())
        return JSONResponse(
            {**self._head(call, "text_completion"), "choices": body, "usage": usage_body(n_prompt, n_out, cached)}
        )

    async def _completion_events(self, call: Call, streams: list[RequestStream], echo: list[str]) -> AsyncIterator[str]:
        head = self._head(call, "text_completion")
        extra = {"usage": None} if call.include_usage else {}
        n = streams[0].n
        choices = [CompletionChoice(i // n) for i in range(len(streams) * n)]
        n_out, last = 0, {}
        try:
            async with contextlib.aclosing(self._merged(call, streams)) as merged:
                async for p, out in merged:
                    i = self._choice_index(streams, p, out)
                    c = choices[i]
                    first = not c.echoed
                    text, lps, prompt_part = self._absorb(call, c, out)
                    if call.echo and first:
                        text = echo[p] + text
                    n_out += 0 if call.drop_output else len(out.token_ids)
                    last[p] = out
                    if not (text or lps or prompt_part or out.finished):
                        continue  # one chunk per engine output (text may be held back)
                    choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None}
                    if call.logprobs is not None:
                        choice["logprobs"] = await self._completion_logprobs(call, prompt_part, lps, c.offset)
                        offsets = choice["logprobs"]["text_offset"]
                        toks = choice["logprobs"]["tokens"]
                        c.offset = offsets[-1] + len(toks[-1]) if toks else c.offset
                    choice["finish_reason"] = out.finish_reason
                    if call.prompt_logprobs is not None and first:
                        choice["prompt_logprobs"] = await self._vllm_prompt_logprobs(call, c)
                    yield json.dumps({**head, "choices": [choice], **extra})
        except Exception as e:
            log.exception("engine error")
            yield json.dumps(APIError(500, f"engine error: {e}").body())
            yield "[DONE]"
            return
        if call.include_usage:
            n_prompt = sum(len(st.prompt_token_ids) for st in streams)
            usage = usage_body(n_prompt, n_out, sum(o.num_cached_prompt_tokens for o in last.values()))
            yield json.dumps({**head, "choices": [], "usage": usage})
        yield "[DONE]"

    async def _token_names(self, call: Call, ids: set[int]) -> Callable[[int], str]:
        if call.body.return_tokens_as_token_ids:
            return lambda t: f"token_id:{t}"
        return (await self._texts(ids)).__getitem__

    async def _completion_logprobs(self, call: Call, prompt_part: list, lps: list, offset: int) -> dict:
        """OpenAI's legacy completions logprobs over the echoed prompt tokens (the first one's
        null: nothing predicts it) and the generated ones: tokens, token_logprobs, top_logprobs
        and text_offset (into the text). Each position's top_logprobs are up to logprobs + 1
        entries, as OpenAI documents and vLLM does: the `logprobs` most likely (split_logprobs'
        order), then the position's own token (sampled or prompt) when not among them, so
        logprobs=0 gives just that token. Chat's top_logprobs stay the n most likely."""
        n = call.logprobs
        rows: list[tuple[int, float | None, list[TokenLogprob] | None]] = []
        for tid, lp in prompt_part:
            if lp is None:
                rows.append((tid, None, None))
            else:
                chosen, top = split_logprobs(lp, n)
                rows.append((tid, chosen.logprob, top))
        for lp in lps:
            chosen, top = split_logprobs(lp, n)
            rows.append((chosen.token_id, chosen.logprob, top))
        name = await self._token_names(call, {t for t, _, top in rows for t in (t, *(x.token_id for x in top or ()))})
        tokens = [name(t) for t, _, _ in rows]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        tops: list[dict[str, float] | None] = []
        for tok, (_, value, top) in zip(tokens, rows):
            if top is None:
                tops.append(None)
                continue
            d = {name(x.token_id): x.logprob for x in top}
            d[tok] = value  # appended when outside the top n (it ranks last); its own value either way
            tops.append(d)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    async def _vllm_prompt_logprobs(self, call: Call, c: CompletionChoice) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}}, the prompt token (its rank in the vocabulary) and the top n."""
        if c.prompt_logprobs is None:
            return None
        n = call.prompt_logprobs
        steps = [None if lp is None else split_logprobs(lp, n) for lp in c.prompt_logprobs]
        name = await self._token_names(call, {t.token_id for s in steps if s is not None for t in (s[0], *s[1])})
        out = []
        for s, rank in zip(steps, c.prompt_ranks):
            if s is None:
                out.append(None)
                continue
            chosen, top = s
            d = {
                str(chosen.token_id): {"logprob": chosen.logprob, "rank": rank, "decoded_token": name(chosen.token_id)}
            }
            for r, t in enumerate(top, 1):
                d.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": r, "decoded_token": name(t.token_id)})
            out.append(d)
        return out
