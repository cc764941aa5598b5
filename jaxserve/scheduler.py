"""Continuous batching on the host: admit, chunk prefills, decode, preempt, finish.

Plain Python: the scheduler hands the engine lists of token ids and page ids and gets back
sampled token ids. Every step it refills free slots from the waiting queue, so no slot idles
while a long request finishes. When pages run out mid-decode, the newest running request is
preempted (pages freed, requeued at the front, recomputed later): oldest-first admission
plus newest-first preemption means the oldest request always makes progress.

A prefill only fills KV for tokens [num_computed, length-1); the last token of every running
sequence is fed by the decode step, which is the only place that samples.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Iterable

from jaxserve.paged_cache import PageAllocator
from jaxserve.request import Sequence, Status


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int


@dataclasses.dataclass
class StepPlan:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]
    copies: list[tuple[int, int]]  # (src, dst) page copies (copy-on-write) to run first
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_slots: int, max_model_len: int,
                 max_prefill_tokens: int, max_prefill_chunk: int, eos_token_ids: Iterable[int] = (),
                 prefix_cache=None, watermark: float = 0.01, lookahead: int = 0):
        self.alloc = allocator
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.eos = frozenset(eos_token_ids)
        self.prefix_cache = prefix_cache
        self.lookahead = lookahead  # speculative decoding writes k positions past the last token
        self.watermark_pages = int(watermark * allocator.capacity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_slots))
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, "abort")
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return seq
        return None

    # -- planning ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        # 1. Every decoding sequence needs a writable page for position length-1; when the
        #    pool runs dry, the newest running request is preempted.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING or seq.prefilling:
                continue
            while not self._reserve(seq, seq.length + self.lookahead, copies):
                victim = max((s for s in self.running if s.status is Status.RUNNING), key=lambda s: s.arrival)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        # 2. Continue chunked prefills, oldest first, under the step's token budget.
        prefills, decodes, budget = [], [], self.max_prefill_tokens
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.prefilling:
                budget = self._plan_chunk(seq, budget, prefills, decodes, copies)
            else:
                decodes.append(seq)
        # 3. Admit from the waiting queue, oldest first, while a slot, its pages and prefill
        #    budget are free. Admitting no more than the budget can prefill means a request
        #    sharing a prefix with one still prefilling waits a step and then hits the cache.
        while self.waiting and self.free_slots and not preempted and budget > 0:
            seq = self.waiting[0]
            if not self._admit(seq, copies):
                break
            self.waiting.popleft()
            if seq.prefilling:
                budget = self._plan_chunk(seq, budget, prefills, decodes, copies)
            elif self._reserve_lookahead(seq, copies):  # the prefix cache held all of it
                decodes.append(seq)
        return StepPlan(prefills, decodes, copies, preempted)

    def _plan_chunk(self, seq: Sequence, budget: int, prefills: list, decodes: list, copies: list) -> int:
        if budget <= 0:
            return budget
        n = min(seq.length - 1 - seq.num_computed, self.max_prefill_chunk, budget)
        prefills.append(PrefillChunk(seq, seq.num_computed, seq.num_computed + n))
        if seq.num_computed + n == seq.length - 1 and self._reserve_lookahead(seq, copies):
            decodes.append(seq)  # its last token is fed by this very step's decode
        return budget - n

    def _reserve_lookahead(self, seq: Sequence, copies: list) -> bool:
        """A sequence joining the decodes mid-step owns pages for the k positions a speculative
        step writes past its last token (the running ones got theirs in step 1). Without them
        it waits: the next step's step 1 reserves them or preempts."""
        return not self.lookahead or self._reserve(seq, seq.length + self.lookahead, copies)

    def _admit(self, seq: Sequence, copies: list) -> bool:
        cache = self.prefix_cache
        match = cache.match(seq.all_ids[:-1]) if cache is not None else None
        cached_pages = match.pages if match else []
        cached_tokens = match.num_tokens if match else 0
        # Pages still to allocate, plus one when a shared partial page must be copied on write.
        need = self.alloc.pages_for(seq.length) - len(cached_pages) + (1 if cached_tokens % self.alloc.page_size else 0)
        reserve = self.watermark_pages if self.running else 0
        if cache is not None and self.alloc.num_free < need + reserve:
            cache.evict(need + reserve - self.alloc.num_free)
        if self.alloc.num_free < need + reserve:
            if match:
                cache.release_match(match)
            return False
        seq.pages = list(cached_pages)
        seq.num_computed = cached_tokens
        if match:
            seq.cache_node = match.node
            cache.record(seq.length - 1, cached_tokens)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached_tokens, len(seq.prompt_ids))
        seq.status = Status.RUNNING
        seq.slot = self.free_slots.pop(0)
        self.running.append(seq)
        ok = self._reserve(seq, seq.length, copies)
        assert ok, "admission reserved fewer pages than it checked for"
        return True

    def _reserve(self, seq: Sequence, num_tokens: int, copies: list) -> bool:
        """Own enough pages for num_tokens, and make the pages about to be written private."""
        while len(seq.pages) < self.alloc.pages_for(num_tokens):
            if not self._ensure_free_page():
                return False
            seq.pages.append(self.alloc.allocate())
        first = seq.num_computed // self.alloc.page_size
        for i in range(first, len(seq.pages)):
            page = seq.pages[i]
            if self.alloc.is_shared(page):
                if not self._ensure_free_page():
                    return False
                new = self.alloc.allocate()
                copies.append((page, new))
                self.alloc.release(page)
                seq.pages[i] = new
        return True

    def _ensure_free_page(self) -> bool:
        """A page is free, evicting a cached prefix for it if the pool is dry."""
        return self.alloc.num_free > 0 or (self.prefix_cache is not None and self.prefix_cache.evict(1) > 0)

    # -- state changes -----------------------------------------------------------------
    def _release_pages(self, seq: Sequence) -> None:
        """Give a request's pages back; with prefix caching, first offer its computed whole
        pages to the tree so the next request (or the next turn) can reuse them."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq.all_ids[: seq.num_computed], seq.pages)
            if seq.cache_node is not None:
                self.prefix_cache.unlock(seq.cache_node)
                seq.cache_node = None
        for p in seq.pages:
            self.alloc.release(p)
        seq.pages = []

    def _preempt(self, seq: Sequence) -> None:
        self._release_pages(seq)
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        seq.slot = None
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self._release_pages(seq)
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            self.free_slots.sort()
            seq.slot = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish from outside the step (a stop string found by the detokenizer)."""
        if seq.status is not Status.FINISHED:
            self._finish(seq, reason)

    def update(self, plan: StepPlan, sampled: dict[str, list[tuple[int, dict[int, float] | None]]]) -> list[Sequence]:
        """Apply a step's results. sampled: request_id -> the new (token, logprobs) pairs, one
        from a plain decode, up to k+1 from a speculative step. Returns the sequences that got
        tokens this step (finished ones included)."""
        for chunk in plan.prefills:
            seq = chunk.seq
            if seq.status is Status.RUNNING:
                seq.num_computed = chunk.end
                if self.prefix_cache is not None:  # after every chunk: later arrivals hit sooner
                    self.prefix_cache.insert(seq.all_ids[: seq.num_computed], seq.pages)
        touched = []
        for seq in plan.decodes:
            if seq.status is not Status.RUNNING or seq.request_id not in sampled:
                continue
            touched.append(seq)
            p = seq.params
            for token, lp in sampled[seq.request_id]:
                seq.output_ids.append(token)
                if lp is not None:
                    seq.logprobs.append(lp)
                seq.num_computed = seq.length - 1
                if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
                    self._finish(seq, "stop")
                elif len(seq.output_ids) >= p.max_tokens or seq.length >= self.max_model_len:
                    self._finish(seq, "length")
                if seq.status is Status.FINISHED:
                    break
            # Roll back speculative lookahead: pages past the new length go back to the pool.
            keep = self.alloc.pages_for(seq.length)
            while seq.status is Status.RUNNING and len(seq.pages) > keep:
                self.alloc.release(seq.pages.pop())
        return touched
