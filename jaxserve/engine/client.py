"""The engine client: what every server frontend (gRPC and HTTP) talks to.

It owns the engine loop thread (which alone calls the core's `step`) and routes each
request's outputs to the asyncio queue of the call that submitted it. Frontends never see
the scheduler, the KV manager or the runner: they `submit` a prompt with its sampling
parameters and async-iterate the outputs, `abort` by id, and read `model_info` and
`stats`. Validation and tokenization run in a worker thread, so a large prompt never
stalls the frontend's event loop (and the other requests' streams on it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import AsyncIterator, Callable
from typing import Sequence as Seq

from jaxserve.engine.chat import Conversation
from jaxserve.engine.contract import Engine, ModelInfo
from jaxserve.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("jaxserve.engine")


class QueueFull(Exception):
    """More requests wait than the client's max_waiting: refuse (RESOURCE_EXHAUSTED / 429)."""


class EngineDead(Exception):
    """An engine step raised: the device state (KV pages, the pending step) can no longer be
    trusted, so the client fails every request in flight, refuses new ones (UNAVAILABLE / 503)
    and tells its owner (`on_fatal`), whose job is to stop the process so a supervisor
    restarts it, rather than serve on from a state nobody can vouch for."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


def split_logprobs(lp: dict[int, float], n: int | None = None) -> tuple[TokenLogprob, list[TokenLogprob]]:
    """A step's logprobs dict (the chosen token first, then the top-n, which may include it) as
    (chosen, the n most likely tokens, most likely first: exactly n, the chosen one among them
    when it is in the top n): the one conversion every frontend formats from. n: the
    request's `logprobs` (None: every entry but the chosen one, the old behaviour)."""
    items = list(lp.items())
    if n is None:
        rest = sorted(items[1:], key=lambda kv: -kv[1])
    else:  # the chosen token ranks after an equally likely alternative
        rest = sorted(items[1:] + items[:1], key=lambda kv: -kv[1])[:n]
    return TokenLogprob(*items[0]), [TokenLogprob(t, v) for t, v in rest]


class RequestStream:
    """One submitted request: its prompt's token ids and an async iterator of its outputs.
    An engine failure arrives as the exception it raised."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], queue: asyncio.Queue, n: int = 1):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._queue = queue
        self.n = n  # completions: outputs carry their `index`; the stream ends when all n have finished
        self._unfinished = n
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out = await self._queue.get()
            if isinstance(out, BaseException):
                self.finished = True
                raise out
            self._unfinished -= out.finished
            self.finished = self._unfinished == 0
            yield out


class EngineClient:
    """Runs an engine core (anything meeting contract.Engine: the jitted EngineCore, or the
    FakeEngine of frontend tests) in a thread and routes its outputs to asyncio queues."""

    def __init__(
        self,
        core: Engine,
        max_waiting: int = 256,
        on_step: Callable[[dict], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self.core = core
        self.max_waiting = max_waiting
        self.on_step = on_step  # called with the engine's stats after every step (metrics)
        self.on_fatal = on_fatal  # called once, from the engine thread, when a step raises
        self.error: BaseException | None = None  # the step failure that ended the loop
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> completions not finished (n > 1)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- requests ----------------------------------------------------------------------
    async def submit(
        self,
        prompt: str | Seq[int] | Conversation,
        params: SamplingParams | Callable[[int], SamplingParams],
        request_id: str | None = None,
    ) -> RequestStream:
        """Validate, tokenize or render the chat (in a worker thread) and queue a request. `params` may be a
        function of the prompt's token count (a default max_tokens that fills the context).
        Raises ValueError naming the field, QueueFull, or EngineDead."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        seq = await loop.run_in_executor(None, self._make_sequence, prompt, params, request_id)
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._check_alive()  # the loop may have died while the prompt was tokenized
            if seq.request_id in self._routes:
                raise ValueError(f"request_id: {seq.request_id!r} is already in use")
            if len(self._routes) - self.core.num_running >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._routes[seq.request_id] = (loop, q)
            self._unfinished[seq.request_id] = seq.params.n
        try:
            self.core.add(seq)
        except BaseException:  # refused (e.g. a completion id already live): nothing stays routed
            with self._lock:
                self._routes.pop(seq.request_id, None)
                self._unfinished.pop(seq.request_id, None)
            raise
        self._wake.set()
        return RequestStream(seq.request_id, seq.prompt_ids, q, seq.params.n)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(f"the engine failed and is shutting down: {self.error!r}")

    def _make_sequence(self, prompt, params, request_id):
        if callable(params):
            ids = self.core.tokenize(prompt)
            return self.core.make_sequence(ids, params(len(ids)), request_id)
        return self.core.make_sequence(prompt, params, request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its slot and pages are free within one engine step."""
        with self._lock:
            found = request_id in self._routes
        if found:
            self.core.abort(request_id)
            self._wake.set()
        return found

    @property
    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._routes)

    @property
    def has_tokenizer(self) -> bool:
        return self.core.tokenizer is not None

    def token_texts(self, token_ids: Seq[int]) -> dict[int, str]:
        """Each token's own text (for logprobs); tokenizer work, so call it off the event loop."""
        tok = self.core.tokenizer
        if tok is None:
            return {t: f"token_id:{t}" for t in token_ids}
        return {t: tok.decode([t]) for t in token_ids}

    def tokenize(self, prompt: str | Conversation, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (BOS and the like only with add_special_tokens) or of chat messages
        rendered by the chat template (/tokenize); tokenizer work, so call it off the event loop."""
        if isinstance(prompt, Conversation):
            return self.core.render_chat(prompt)
        tok = self.core.tokenizer
        if tok is None:
            raise ValueError(f"prompt: {self.core.model_path.name} has no tokenizer")
        return tok.encode(prompt, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Seq[int]) -> str:
        """The text of token ids, special tokens included (/detokenize, echo of a token-id prompt)."""
        self.core.check_in_vocab("tokens", token_ids)
        tok = self.core.tokenizer
        if tok is None:
            raise ValueError(f"tokens: {self.core.model_path.name} has no tokenizer")
        return tok.decode(list(token_ids))

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the special tokens and the chat template (lm-eval's remote tokenizer)."""
        tok = self.core.tokenizer
        if tok is None:
            raise ValueError(f"model: {self.core.model_path.name} has no tokenizer")
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.core.max_model_len,
        }

    def model_info(self) -> ModelInfo:
        return self.core.model_info()

    def stats(self) -> dict:
        return self.core.stats()

    # -- the loop ----------------------------------------------------------------------
    def _deliver(self, out: RequestOutput | BaseException, request_id: str, last: bool) -> None:
        """last: the request's stream ends here (an error, or a finished output: the last of its n)."""
        with self._lock:
            if last and isinstance(out, RequestOutput) and self._unfinished.get(request_id, 1) > 1:
                self._unfinished[request_id] -= 1
                last = False
            if last:
                self._unfinished.pop(request_id, None)
            route = self._routes.pop(request_id, None) if last else self._routes.get(request_id)
        if route is not None:
            loop, q = route
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _run(self) -> None:
        while not self._stop:
            if not self.core.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception as e:  # fail loudly: every stream gets the error, the owner stops the process
                log.exception("engine step failed: failing every request in flight")
                with self._lock:
                    self.error = e
                for rid in self.in_flight:
                    self._deliver(e, rid, last=True)
                if self.on_fatal is not None:
                    self.on_fatal(e)
                return
            for out in outputs:
                self._deliver(out, out.request_id, last=out.finished)
            if self.on_step is not None:
                self.on_step(self.core.stats())
