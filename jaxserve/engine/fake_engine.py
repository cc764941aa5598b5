"""A fake engine core for frontend tests: the engine contract (contract.Engine) with the real
scheduler, KV manager, prefix cache, detokenizer and request types, and a fake model whose
tokens are a fixed function of the prompt, so no jax is imported and nothing compiles.

What the frontends see is what the jitted core gives them: `RequestOutput` deltas with text from a
real tokenizer (a word-level one built in memory: token i is the word "w<i>", ids 0-2 are <s>,
</s>, <unk>), stop strings held back and cut, stop token ids, EOS, max_tokens and max_model_len,
n completions, aborts that free pages at the next step, prefix-cache hits, logprobs and prompt
logprobs, `stats()` and `model_info()` with the core's keys and fields. A test knows every token
before it asks (`FakeModel.tokens`), so the oracle of a frontend test is the model function and
the invariants of the pool, not a second engine run.

What it does not do: sampling (temperature, top-k/p, seeds, penalties and biases are validated
and ignored: every request decodes the model function) and output constraints (refused with a
ValueError naming the field). `step_seconds` stands in for the device's step time, so a stream
lasts long enough for a test to disconnect from it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any
from typing import Sequence as Seq

from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.contract import ModelInfo
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.intake import Intake
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import RequestOutput, SamplingParams, Sequence
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.tokenizer import FastDecode, word_tokenizer

BOS, EOS, FIRST_WORD = 0, 1, 3  # the word tokenizer's <s>, </s>; <unk> is 2; words from 3

# Role and content as words, so a conversation's ids are its words' (a template the fake serves).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


@dataclasses.dataclass(frozen=True)
class FakeModel:
    """The fake's weights: output token i of completion `index` of a prompt is a fixed function
    of the prompt's ids, the index and i, always a word (>= FIRST_WORD); `eos_at`: completions
    emit EOS as their output token number eos_at instead (None: never)."""

    vocab_size: int = 512
    eos_at: int | None = None

    def token(self, prompt_ids: Seq[int], index: int, i: int) -> int:
        if self.eos_at is not None and i == self.eos_at - 1:
            return EOS
        h = 31 * sum(prompt_ids) + 7 * len(prompt_ids) + 101 * index + 13 * i
        return FIRST_WORD + h % (self.vocab_size - FIRST_WORD)

    def tokens(self, prompt_ids: Seq[int], n: int, index: int = 0) -> list[int]:
        """The first n output tokens (what a request gets before any stop applies)."""
        return [self.token(prompt_ids, index, i) for i in range(n)]

    def logprobs(self, token: int, top: int) -> dict[int, float]:
        """The chosen token first and most likely (-0.25), then top - 1 others, each a nat less
        likely than the one before: a step's logprobs dict as the core returns it."""
        span = self.vocab_size - FIRST_WORD
        others = [FIRST_WORD + (token - FIRST_WORD + k) % span for k in range(1, top)]
        return {token: -0.25, **{t: -0.25 - k for k, t in enumerate(others, start=1)}}


class FakeEngine(Intake):
    """The engine contract over a fake model. Build it with the core's options (EngineConfig:
    max_slots, page_size, max_model_len, num_pages, token_buckets, enable_prefix_caching, ...)."""

    def __init__(self, model: FakeModel | None = None, *, name: str = "fake", step_seconds: float = 0.002, **options):
        self.model = model or FakeModel()
        self.cfg = EngineConfig(**options)
        self.model_path = Path(name)
        self.max_model_len = self.cfg.max_model_len or 2048
        self.step_seconds = step_seconds
        self.tokenizer: Any | None = word_tokenizer(self.model.vocab_size, specials=True)
        self.tokenizer.chat_template = CHAT_TEMPLATE
        page = self.cfg.page_size
        num_pages = self.cfg.num_pages or self.cfg.max_slots * -(-self.max_model_len // page) + 1
        budget = self.cfg.max_num_batched_tokens or (self.cfg.token_buckets or (256,))[-1]
        allocator = PageAllocator(num_pages, page)
        self.kv = KVManager(allocator, RadixCache(allocator) if self.cfg.enable_prefix_caching else None)
        self.scheduler = Scheduler(
            self.kv,
            self.cfg.max_slots,
            self.max_model_len,
            max_num_batched_tokens=budget,
            eos_token_ids=(EOS,),
            max_prefill_tokens_while_decoding=self.cfg.max_prefill_tokens_while_decoding,
            token_buckets=self.cfg.token_buckets or (budget,),
        )
        self._decoder = FastDecode(self.tokenizer)
        self._init_intake(self.cfg.seed)

    # -- requests (and engine/intake.py) --------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def grammar(self, params: SamplingParams) -> None:
        if params.constraint is not None:
            raise ValueError(f"{params.constraint[0]}: the fake engine does not constrain its outputs")
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty()

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Take the inbox, plan with the real scheduler, "run" the plan (sleep step_seconds, the
        fake model's tokens), apply it, and return each touched request's delta."""
        finished_now = self._drain_inbox()
        plan = self.scheduler.schedule()
        if not plan.empty and self.step_seconds:
            time.sleep(self.step_seconds)
        for chunk in plan.prefills:
            self._score_prompt(chunk.seq, chunk.start, chunk.end)
        sampled = {s.request_id: [self._sample(s)] for s in plan.decodes}
        touched = self.scheduler.update(plan, sampled)
        once = list({id(s): s for s in touched + finished_now}.values())
        return [self._output(seq) for seq in once]

    def _sample(self, seq: Sequence) -> tuple[int, dict[int, float] | None]:
        token = self.model.token(seq.prompt_ids, seq.index, len(seq.output_ids))  # EOS too: ignore_eos keeps it
        lp = seq.params.logprobs
        return token, (self.model.logprobs(token, max(lp, 1)) if lp is not None else None)

    def _score_prompt(self, seq: Sequence, start: int, end: int) -> None:
        """Prompt logprobs of positions [start, end) + 1 (a prefill chunk predicts the next token)."""
        if seq.prompt_logprobs is None:
            return
        top = max(seq.params.prompt_logprobs, 1)
        for pos in range(max(start, 0) + 1, min(end + 1, len(seq.prompt_ids))):
            seq.prompt_logprobs[pos] = self.model.logprobs(seq.prompt_ids[pos], top)
            seq.prompt_ranks[pos] = 1

    # -- reports --------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            **self._pool_stats(),
            "grammar_mask_seconds": 0.0,
            "grammar_mask_steps": 0,
            "overlapped_steps": 0,
            "multi_step_calls": 0,
            "multi_step_steps": 0,
        }

    def model_info(self) -> ModelInfo:
        features = ["attention:fake", "matmul:fake", "kv_cache:fake"]
        if self.kv.prefix_cache is not None:
            features.append("prefix_caching")
        return ModelInfo(
            self.model_path.name,
            self.max_model_len,
            self.model.vocab_size,
            tuple(features),
            self.cfg.max_slots,
            self.cfg.page_size,
            self.kv.capacity,
            self.tokenizer is not None,
        )

    def compiles_since_warmup(self) -> int:
        return 0  # nothing compiles

    @property
    def is_follower(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass
