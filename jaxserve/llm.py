"""The offline API: LLM, SamplingParams, RequestOutput; the server uses the same engine.

LLM glues the host loop together: validate and tokenize requests, run the scheduler's plan
on the engine, detokenize incrementally and apply stop strings. add_request and abort are
thread-safe (they go through an inbox drained at the start of each step), so a server can
run `step()` in one thread and talk to it from others.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import sys
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Sequence as Seq

import numpy as np

from jaxserve.engine import Engine, EngineConfig, bucket_for, compile_count
from jaxserve.paged_cache import PageAllocator
from jaxserve.radix_cache import RadixCache
from jaxserve.request import RequestOutput, SamplingParams, Sequence, Status
from jaxserve.scheduler import Scheduler

log = logging.getLogger("jaxserve.llm")

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "assets" / "models" / "default" / "target"
DEFAULT_DRAFT = REPO_ROOT / "assets" / "models" / "default" / "draft"


def load_tokenizer(path: Path):
    """The checkpoint's own tokenizer, or None: token-id prompts still work without one."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    if (path / "tokenizer.json").is_file() and _tokenizer_class(path) in _GENERIC_TOKENIZERS:
        # The class AutoTokenizer would pick, without importing the auto machinery: that
        # imports every model config and, where torch is installed, torch (about 1.5 s a start).
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


@dataclasses.dataclass
class _Detok:
    """Incremental detokenization state (vLLM's prefix/read offsets): decode a short window
    so each step costs O(1) tokens, and hold back text that ends inside a UTF-8 character."""

    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0


class LLM:
    def __init__(self, model: str | Path | None = None, *, warmup: bool = True, log_progress: bool = False,
                 **engine_options):
        from jaxserve.models.loader import load_model

        path = Path(model) if model is not None else DEFAULT_MODEL
        self.cfg = EngineConfig(**engine_options)
        module, self.model_cfg = load_model(path, dtype=self.cfg.dtype)
        self.model_path = path
        self.tokenizer = load_tokenizer(path)
        draft, draft_cfg = self._load_draft()
        self.engine = Engine(module, self.model_cfg, self.cfg, draft, draft_cfg)
        self.spec_k = self.engine.spec_k
        self.speculative_name = None
        self.spec_stats = None
        if self.spec_k:
            from jaxserve.speculative import SpecStats

            self.speculative_name = "ngram" if draft is None else Path(self.cfg.speculative_model).name
            self.spec_stats = SpecStats(self.spec_k)
        self.max_model_len = self.engine.max_model_len
        self.allocator = PageAllocator(self.engine.num_pages, self.cfg.page_size)
        self.prefix_cache = RadixCache(self.allocator) if self.cfg.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator, self.cfg.max_slots, self.max_model_len,
            max_prefill_tokens=self.cfg.max_prefill_tokens, max_prefill_chunk=self.engine.prefill_buckets[-1],
            eos_token_ids=self._eos_ids(), prefix_cache=self.prefix_cache, lookahead=self.spec_k)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, _Detok] = {}
        self._arrival = itertools.count()
        self._rng = np.random.default_rng(self.cfg.seed)
        if self.is_follower:
            # Another host's process: replay the leader's engine calls (its warm-up included)
            # until it shuts down. The scheduler and server run on process 0 only.
            self.engine.broadcaster.follow(self.engine)
            self._compiles_at_warmup = compile_count()
            return
        if warmup:
            say = (lambda m: print(f"[jaxserve] {m}", file=sys.stderr, flush=True)) if log_progress else None
            secs = self.engine.warmup(say)
            store = self.engine.store
            log.info("warm-up compiled every bucket in %.1fs%s", secs,
                     f" ({store.loaded} executables loaded from {store.dir}, {store.saved} compiled and saved)"
                     if store is not None else "")
        self._compiles_at_warmup = compile_count()

    def _load_draft(self):
        spec = self.cfg.speculative_model
        if spec is None or spec == "ngram":
            return None, None
        if self.cfg.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.cfg.num_speculative_tokens}")
        from jaxserve.models.loader import load_model

        draft, dcfg = load_model(DEFAULT_DRAFT if spec == "default" else spec, dtype=self.cfg.dtype)
        if dcfg.vocab_size != self.model_cfg.vocab_size:
            raise ValueError(f"speculative_model: the draft's vocabulary ({dcfg.vocab_size}) differs from the "
                             f"target's ({self.model_cfg.vocab_size})")
        return draft, dcfg

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def compiles_since_warmup(self) -> int:
        return compile_count() - self._compiles_at_warmup

    # -- requests ----------------------------------------------------------------------
    def make_sequence(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                      request_id: str | None = None) -> Sequence:
        """Validate and tokenize; raises ValueError naming the field before anything is scheduled."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: {self.model_path} has no tokenizer; send token ids instead of text")
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not ids:
                raise ValueError("prompt: the text tokenizes to no tokens")
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompt: must not be empty")
            bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({self.max_model_len})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        return Sequence(request_id=request_id or uuid.uuid4().hex, prompt_ids=ids, params=params, seed=seed,
                        arrival=next(self._arrival))

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self.submit(self.make_sequence(prompt, params, request_id))

    def submit(self, seq: Sequence) -> str:
        """Queue a sequence made by make_sequence (thread-safe)."""
        self._inbox.put(("add", seq))
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Takes effect at the start of the next step: the slot and pages are free within one step."""
        self._inbox.put(("abort", request_id))

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of several: it only replays process 0's engine calls."""
        bc = self.engine.broadcaster
        return bc is not None and not bc.leader

    def shutdown(self) -> None:
        """With several processes, release the followers (they return from LLM())."""
        bc = self.engine.broadcaster
        if bc is not None and bc.leader:
            bc.send("stop", ())

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns pages freed."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def stats(self) -> dict:
        pc = self.prefix_cache
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_pages_total": self.allocator.capacity, "kv_pages_free": self.allocator.num_free,
            "kv_pages_used": self.allocator.capacity - self.allocator.num_free,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": pc.hit_tokens if pc else 0,
            "prefix_cache_queried_tokens": pc.queried_tokens if pc else 0,
            "prefix_cache_hit_rate": pc.hit_rate if pc else 0.0,
            "prefix_cache_pages": pc.num_cached_pages if pc else 0,
            **(self.spec_stats.as_dict() if self.spec_stats else {}),
        }

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty()

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns each touched request's output since its last one."""
        finished_now: list[Sequence] = []
        while not self._inbox.empty():
            op, arg = self._inbox.get()
            if op == "add":
                if arg.request_id in self._seqs:
                    finished_now.append(arg)
                    arg.status, arg.finish_reason = Status.FINISHED, "abort"
                    log.warning("duplicate request id %s rejected", arg.request_id)
                    continue
                self._seqs[arg.request_id] = arg
                self._detok[arg.request_id] = _Detok(prefix_offset=0, read_offset=0)
                self.scheduler.add(arg)
            elif op == "abort":
                seq = self.scheduler.abort(arg)
                if seq is not None:
                    finished_now.append(seq)
        plan = self.scheduler.schedule()
        if plan.copies:
            self.engine.copy_pages(plan.copies)
        if plan.prefills:
            self.engine.prefill([(c.seq.all_ids[c.start:c.end], c.start, c.seq.pages) for c in plan.prefills])
        if not plan.decodes:
            sampled = {}
        elif self.spec_k and not any(s.params.logprobs is not None for s in plan.decodes):
            sampled = self._speculate(plan.decodes)
        else:  # logprobs come from the plain decode step
            sampled = self._decode(plan.decodes)
        touched = self.scheduler.update(plan, sampled)
        outputs = []
        for seq in touched + finished_now:
            out = self._output(seq)
            if out is not None:
                outputs.append(out)
        return outputs

    def _rows(self, seqs: list[Sequence]):
        """Device inputs for a decode over `seqs`: one row each, longest context first (the
        attention groups rows by length), padded to a batch bucket. Returns (rows, arrays)."""
        rows = sorted(seqs, key=lambda s: -s.length)
        s = bucket_for(self.engine.batch_buckets, len(rows))
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        active = np.zeros(s, bool)
        temperature = np.zeros(s, np.float32)
        top_k = np.zeros(s, np.int32)
        top_p = np.ones(s, np.float32)
        seeds = np.zeros((s, 2), np.uint32)
        counters = np.zeros(s, np.int32)
        tables: list[list[int]] = [[] for _ in range(s)]
        for i, seq in enumerate(rows):
            p = seq.params
            tokens[i] = seq.all_ids[-1]
            positions[i] = seq.length - 1
            active[i] = True
            temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            seeds[i] = (seq.seed & 0xFFFFFFFF, seq.seed >> 32)
            counters[i] = len(seq.output_ids)
            tables[i] = seq.pages
        return rows, (tokens, positions, tables, active, temperature, top_k, top_p, seeds, counters)

    def _decode(self, seqs: list[Sequence]) -> dict[str, list[tuple[int, dict[int, float] | None]]]:
        rows, arrays = self._rows(seqs)
        want_lp = max((s.params.logprobs + 1 for s in seqs if s.params.logprobs is not None), default=0)
        r = self.engine.decode(*arrays, want_lp)
        out = {}
        for i, seq in enumerate(rows):
            n = seq.params.logprobs
            tok = int(r.tokens[i])
            lp = None
            if n is not None:
                lp = {tok: float(r.logprobs[i])}
                for j in range(n):
                    lp.setdefault(int(r.top_ids[i, j]), float(r.top_logprobs[i, j]))
            out[seq.request_id] = [(tok, lp)]
        return out

    def _speculate(self, seqs: list[Sequence]) -> dict[str, list[tuple[int, None]]]:
        rows, (tokens, positions, tables, active, temperature, top_k, top_p, seeds, counters) = self._rows(seqs)
        proposals = None
        if self.engine.draft is None:
            from jaxserve.speculative import ngram_propose

            proposals = [ngram_propose(seq.all_ids, self.spec_k) for seq in rows] + [[]] * (len(active) - len(rows))
        out, n_out, num_drafts = self.engine.speculate(tokens, positions, tables, active, proposals, temperature,
                                                       top_k, top_p, seeds, counters)
        result = {}
        for i, seq in enumerate(rows):
            self.spec_stats.record(int(num_drafts[i]), int(n_out[i]))
            result[seq.request_id] = [(int(t), None) for t in out[i, : n_out[i]]]
        return result

    def _output(self, seq: Sequence) -> RequestOutput | None:
        d = self._detok.get(seq.request_id)
        if d is None:  # rejected duplicate id
            return RequestOutput(seq.request_id, seq.prompt_ids, [], "", "abort")
        if self.tokenizer is not None:
            self._detokenize(seq, d)
        finished = seq.status is Status.FINISHED
        hold = 0 if finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        end = max(d.sent_text, len(d.text) - hold)
        out = RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_ids, token_ids=seq.output_ids[d.sent_tokens:],
            text=d.text[d.sent_text:end], finish_reason=seq.finish_reason,
            logprobs=seq.logprobs[d.sent_logprobs:] if seq.params.logprobs is not None else None,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens)
        d.sent_text, d.sent_tokens, d.sent_logprobs = end, len(seq.output_ids), len(seq.logprobs)
        if finished:
            self._seqs.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
        return out

    def _detokenize(self, seq: Sequence, d: _Detok) -> None:
        tok = self.tokenizer
        ids = seq.output_ids
        if seq.finish_reason == "stop" and ids and ids[-1] in self.scheduler.eos | set(seq.params.stop_token_ids):
            ids = ids[:-1]  # the stop token itself is not text
        while d.read_offset < len(ids):
            prefix = tok.decode(ids[d.prefix_offset:d.read_offset], skip_special_tokens=True)
            new = tok.decode(ids[d.prefix_offset:], skip_special_tokens=True)
            if len(new) > len(prefix) and not new.endswith("\ufffd"):
                d.text += new[len(prefix):]
                d.prefix_offset, d.read_offset = d.read_offset, len(ids)
            else:
                break
        if seq.params.stop and seq.finish_reason != "abort":
            longest = max(map(len, seq.params.stop))
            window_start = max(0, d.sent_text - longest)
            hits = [i for i in (d.text.find(s, window_start) for s in seq.params.stop) if i >= 0]
            if hits:
                d.text = d.text[: min(hits)]
                self.scheduler.finish(seq, "stop")

    # -- conveniences ------------------------------------------------------------------
    def generate(self, prompts: Seq[str] | Seq[Seq[int]] | str,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]  # validate all first
        for seq in seqs:
            self.submit(seq)
        results = {s.request_id: RequestOutput(s.request_id, s.prompt_ids, [], "", None,
                                               [] if s.params.logprobs is not None else None) for s in seqs}
        for out in self._run_until({s.request_id for s in seqs}):
            _merge(results[out.request_id], out)
        return [results[s.request_id] for s in seqs]

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield incremental outputs of one request as they are produced (offline use)."""
        rid = self.add_request(prompt, params)
        yield from self._run_until({rid})

    def _run_until(self, ids: set[str]) -> Iterable[RequestOutput]:
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in ids:
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    acc.token_ids.extend(delta.token_ids)
    acc.text += delta.text
    acc.finish_reason = delta.finish_reason
    acc.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
    if delta.logprobs is not None:
        acc.logprobs.extend(delta.logprobs)
