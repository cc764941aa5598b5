"""The offline API: LLM, SamplingParams, RequestOutput.

`LLM` is the engine core driven from the caller's thread: `generate` and `stream` submit
requests and step the core until they finish. `add_request`, `step` and `abort` are the
streaming interface (thread-safe submission through the core's inbox). The servers use the
same core through `jaxserve.engine.client.EngineClient`.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from pathlib import Path
from typing import Iterable, Iterator
from typing import Sequence as Seq

import numpy as np

from jaxserve.engine.chat import Conversation, is_conversation
from jaxserve.engine.contract import completion_ids
from jaxserve.engine.loading import load_engine
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence
from jaxserve.engine.tool_calls import ToolCalling, ToolRequest

log = logging.getLogger("jaxserve.llm")

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


class LLM:
    def __init__(
        self, model: str | Path | None = None, *, warmup: bool = True, log_progress: bool = False, **engine_options
    ):
        self.core = load_engine(model, warmup=warmup, log_progress=log_progress, **engine_options)
        self._tool_calling: ToolCalling | None = None

    # What a user (and the tests) inspect: the core's parts, read-only.
    @property
    def cfg(self):
        return self.core.cfg

    @property
    def model_cfg(self):
        return self.core.model_cfg

    @property
    def model_path(self) -> Path:
        return self.core.model_path

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def runner(self):
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def allocator(self):
        return self.core.kv.alloc

    @property
    def prefix_cache(self):
        return self.core.kv.prefix_cache

    @property
    def spec_stats(self):
        return self.core.spec_stats

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of several: it only replays process 0's runner calls."""
        return self.core.is_follower

    def shutdown(self) -> None:
        """With several processes, release the followers (they return from LLM())."""
        self.core.shutdown()

    def compiles_since_warmup(self) -> int:
        return self.core.compiles_since_warmup()

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns pages freed."""
        return self.core.flush_prefix_cache()

    def stats(self) -> dict:
        return self.core.stats()

    # -- requests ----------------------------------------------------------------------
    def make_sequence(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        """Validate and tokenize; raises ValueError naming the field before anything is scheduled."""
        return self.core.make_sequence(prompt, params, request_id)

    def add_request(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        return self.submit(self.make_sequence(prompt, params, request_id))

    def submit(self, seq: Sequence) -> str:
        """Queue a sequence made by make_sequence (thread-safe)."""
        return self.core.add(seq)

    def abort(self, request_id: str) -> None:
        """Takes effect at the start of the next step: the slot and pages are free within one step."""
        self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns each touched request's output since its last one."""
        return self.core.step()

    # -- conveniences ------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, Conversation):  # chat messages in a list are refused with each prompt (core)
            raise ValueError("prompt: a conversation is not a prompt; use LLM.chat for it")
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (Seq, np.ndarray)):
            raise ValueError(
                f"prompt: must be text, a list of token ids, or a list of those, got {type(prompts).__name__}"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]  # validate all first
        for seq in seqs:
            self.submit(seq)
        # One output per completion: n > 1 gives n consecutive outputs (index 0..n-1) for a prompt.
        keys = [(s.request_id, i) for s in seqs for i in range(s.params.n)]
        results = {
            (s.request_id, i): RequestOutput(
                s.request_id, s.prompt_ids, [], "", None, [] if s.params.logprobs is not None else None, index=i
            )
            for s in seqs
            for i in range(s.params.n)
        }
        for out in self._run_until({s.request_id: s.params.n for s in seqs}):
            _merge(results[(out.request_id, out.index)], out)
        return [results[k] for k in keys]

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        tools: Seq[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or to each of a list of
        them; each is rendered with the checkpoint's chat template, ending with the assistant's
        generation prompt. ValueError naming `messages` if the checkpoint has no template.

        tools, tool_choice, parallel_tool_calls: OpenAI's (engine/tool_calls.py). Each output's
        `tool_calls` is then the list of calls parsed from the reply (ToolCall: id, name,
        arguments as JSON text) and its `text` the rest; tool_choice "required" or a function
        enforces calls with a grammar, so sampling_params may not carry another constraint."""
        if isinstance(messages, Conversation):
            messages = [messages]
        if not isinstance(messages, Seq) or isinstance(messages, str) or not messages:
            raise ValueError(
                "messages: must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)"
            )
        conversations = [messages] if is_conversation(messages) else list(messages)
        request = ToolRequest.of(tools, tool_choice, parallel_tool_calls)
        tc = self.tool_calling
        prompts = [
            Conversation.of(tc.messages(Conversation.of(c).messages, request), tc.template_tools(request))
            for c in conversations
        ]
        grammar = tc.grammar(request)
        if grammar is not None:
            if sampling_params is None or isinstance(sampling_params, SamplingParams):
                sampling_params = [sampling_params or SamplingParams()] * len(prompts)
            sampling_params = [dataclasses.replace(sp, grammar=grammar) for sp in sampling_params]
        outputs = self.generate(prompts, sampling_params)
        if tc.parser(request) is not None:
            for out in outputs:
                parser = tc.parser(request)
                parser.feed(out.text)
                parser.finish()
                out.text, out.tool_calls = parser.content, parser.tool_calls()
        return outputs

    @property
    def tool_calling(self) -> ToolCalling:
        """How this checkpoint's template writes tool calls (the `tool_call_parser` option, or
        detected from the template)."""
        if self._tool_calling is None:
            self._tool_calling = ToolCalling.for_tokenizer(self.tokenizer, self.cfg.tool_call_parser)
        return self._tool_calling

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield incremental outputs of one request as they are produced (offline use)."""
        rid = self.add_request(prompt, params)
        yield from self._run_until({rid: (params or SamplingParams()).n})

    def _run_until(self, ids: dict[str, int]) -> Iterable[RequestOutput]:
        """Step until each request id has finished its count of completions. Left early (the
        caller closes the generator, or a step raises), it aborts the requests still running and
        steps until they are gone, so their slots and pages return to the pool."""
        pending = dict(ids)
        try:
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending[out.request_id] -= 1
                            if not pending[out.request_id]:
                                del pending[out.request_id]
                        yield out
        finally:
            if pending:
                self._abandon({rid: ids[rid] for rid in pending})

    def _abandon(self, ids: dict[str, int]) -> None:
        """Abort these requests (id: number of completions) and step until none is live."""
        live = [cid for rid, n in ids.items() for cid in completion_ids(rid, n)]
        for rid in ids:
            self.abort(rid)
        try:
            for _ in range(_ABANDON_STEPS):
                if not self.core.any_live(live):
                    return
                self.step()
            log.warning("requests %s still live %d steps after their abort", sorted(ids), _ABANDON_STEPS)
        except Exception:  # the step that raised first is the error to report
            log.exception("stepping to drain the aborted requests %s failed", sorted(ids))


# An abort takes effect at the start of the next step; an async step in flight adds one more.
_ABANDON_STEPS = 16


def _is_token_ids(prompt: object) -> bool:
    """One prompt of token ids (a 1-D numpy array, or a sequence whose first item is an
    integer), as opposed to a list of prompts."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1
    return (
        isinstance(prompt, Seq)
        and bool(prompt)
        and isinstance(prompt[0], numbers.Integral)
        and not isinstance(prompt[0], bool)
    )


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    acc.token_ids.extend(delta.token_ids)
    acc.text += delta.text
    acc.finish_reason = delta.finish_reason
    acc.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
    if delta.logprobs is not None:
        acc.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs, acc.prompt_ranks = delta.prompt_logprobs, delta.prompt_ranks
