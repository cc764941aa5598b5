"""Continuous batching on the host: admit, chunk prefills, decode, preempt, finish.

Plain Python: the scheduler hands the engine lists of token ids and page ids and gets back
sampled token ids. Every step it refills free slots from the waiting queue, so no slot idles
while a long request finishes. When pages run out mid-decode, the newest running request is
preempted (pages freed, requeued at the front, recomputed later): oldest-first admission
plus newest-first preemption means the oldest request always makes progress.

There are no prefill and decode phases: each step has a token budget
(`max_num_batched_tokens`, vLLM v1's), spent on a decode token for every running sequence
first, then on prompt chunks, shortest remaining prompt first (and, while any sequence decodes,
at most `max_prefill_tokens_while_decoding` of them); a prompt may be split across steps. The plan goes
to the device as ONE ragged step (runner/step_batch.py): a decode row is one token, a chunk
many, and a sequence whose chunk reaches its last prompt token samples its first output token
in the same row.

A prompt chunk fills KV for tokens [num_computed, length-1); the last token of every running
sequence is fed as its decode token, the only one that samples (in the same row as a prompt's
last chunk). That keeps one sampling path and makes a 1-token prompt and a preempted request's
recompute the same case as any other.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from typing import Iterable

from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.request import Sequence, Status


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int


@dataclasses.dataclass
class StepPlan:
    """One step's work (vLLM's SchedulerOutput): prompt chunks, the sequences that feed (and
    sample) their last token, page copies to run first, and who was preempted."""

    prefills: list[PrefillChunk]
    decodes: list[Sequence]
    copies: list[tuple[int, int]]  # (src, dst) page copies (copy-on-write) to run first
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Tokens each request computes this step (its row of the ragged step)."""
        out = {c.seq.request_id: c.end - c.start for c in self.prefills}
        for seq in self.decodes:
            out[seq.request_id] = out.get(seq.request_id, 0) + 1
        return out


class Scheduler:
    """Decides which sequences run this step and how much of each; the KV manager decides
    which pages that takes."""

    PROMPT_SKIPS = 16  # steps a prompt may be passed over by shorter ones before it goes first

    def __init__(
        self,
        kv: KVManager,
        max_slots: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        eos_token_ids: Iterable[int] = (),
        lookahead: int = 0,
        max_prefill_tokens_while_decoding: int | None = None,
        token_buckets: tuple[int, ...] = (),
    ):
        self.kv = kv
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = frozenset(eos_token_ids)
        self.lookahead = lookahead  # speculative decoding writes k positions past the last token
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.token_buckets = token_buckets  # the step's padded sizes (the cap fills one, not spills past it)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_slots))
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort a request: every one of its n completions still waiting or running."""
        hit = [s for s in list(self.waiting) + self.running if request_id in (s.request_id, s.parent_id)]
        for seq in hit:
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
            self._finish(seq, "abort")
        return hit

    # -- planning ----------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> StepPlan:
        """num_steps > 1: the decodes may run that many steps in one call (the engine's
        num_scheduler_steps): each owns pages for the tokens it can still keep of them."""
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        # `running` is kept oldest first (`_take_slot`), so one pass sorts it into the sequences
        # that decode this step and those still prefilling (no sort per step).
        decoding, prompts = self._partition(self.running)
        # 1. Every decoding sequence needs a writable page for position length-1; when the
        #    pool runs dry, the newest running request is preempted. The cached prefixes that
        #    must make room are evicted in one pass first (the same least-recently-used leaves
        #    one eviction per page would drop).
        self._evict_for(decoding, num_steps)
        for seq in decoding:
            if seq.status is not Status.RUNNING:
                continue
            while not self.kv.allocate_slots(seq, self._decode_tokens(seq, num_steps), copies):
                victim = max((s for s in self.running if s.status is Status.RUNNING), key=self._age)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        # 2. The token budget: a decode token for every running sequence first. While any
        #    sequence decodes, prompt chunks get at most `max_prefill_tokens_while_decoding` of
        #    what is left: a streaming client's inter-token gap is the step's time.
        if preempted:
            decodes = [s for s in decoding if s.status is Status.RUNNING]
            prompts = [s for s in prompts if s.status is Status.RUNNING]
        else:
            decodes = decoding
        per_decode = 1 + self.lookahead  # a speculative row: its last token and k drafts
        prefills, budget = [], self.max_num_batched_tokens - len(decodes) * per_decode
        if decodes and self.max_prefill_tokens_while_decoding is not None:
            budget = min(budget, self._prefill_cap(len(decodes) * per_decode))
        # 3. Prompt chunks, the shortest remaining prompt first (a short prompt's first token is
        #    not held behind a long prompt's chunks), taking the waiting queue's head (oldest
        #    first) into a free slot when its turn comes. Admitting no more than the budget can
        #    prefill means a request sharing a prefix with one still prefilling waits a step and
        #    then hits the cache. A prompt passed over for `PROMPT_SKIPS` steps goes first.
        prefilling = sorted(prompts, key=self._prompt_order)
        candidates = {id(s): s for s in prefilling}  # the prompts that want budget this step
        admitting = not preempted
        while budget > 0:
            head = self.waiting[0] if admitting and self.waiting and self.free_slots else None
            if head is not None and (not prefilling or self._prompt_order(head) < self._prompt_order(prefilling[0])):
                candidates[id(head)] = head
                if not self._admit_head(head, copies):
                    admitting = False
                    continue
                if head.prefilling:
                    budget = self._plan_chunk(head, budget, prefills, decodes, copies)
                elif self._reserve_lookahead(head, copies):  # the prefix cache held all of it
                    decodes.append(head)
                    budget -= 1 + self.lookahead
            elif prefilling:
                budget = self._plan_chunk(prefilling.pop(0), budget, prefills, decodes, copies)
            else:
                break
        if self.waiting and self.free_slots:
            candidates[id(self.waiting[0])] = self.waiting[0]
        planned = {id(c.seq) for c in prefills}
        for seq in candidates.values():
            passed_over = id(seq) not in planned and (seq.status is Status.WAITING or seq.prefilling)
            seq.prompt_skips = seq.prompt_skips + 1 if passed_over else 0
        return StepPlan(prefills, decodes, copies, preempted)

    def _partition(self, running: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences (oldest first) that decode this step, and those still
        prefilling their prompt; a sequence whose pending last token finishes it by length
        (`_last_token_pending`) is in neither. Inlined: it runs for every row every step."""
        decoding, prompts = [], []
        mml = self.max_model_len
        for s in running:
            length = len(s.prompt_ids) + len(s.output_ids) + s.num_pending
            if s.num_computed < length - 1:
                prompts.append(s)
            elif not s.num_pending or (
                len(s.output_ids) + s.num_pending < s.params.max_tokens and length < mml
            ):  # not _last_token_pending(s)
                decoding.append(s)
        return decoding, prompts

    def _evict_for(self, decoding: list[Sequence], num_steps: int) -> None:
        """Evict, in one pass, the cached prefixes the decodes' new pages need beyond the free
        ones (copy-on-write pages are left to allocate_slots, which evicts for them itself)."""
        kv = self.kv
        cache, free = kv.prefix_cache, kv.alloc.num_free
        if cache is None or free >= len(decoding) * (1 + max(self.lookahead, num_steps - 1)):
            return  # enough free pages whatever each needs (the common case: no per-row count)
        ps = kv.page_size
        need = sum(max(0, -(-self._decode_tokens(s, num_steps) // ps) - len(s.pages)) for s in decoding)
        if need > free:
            cache.evict(need - free)

    def _prefill_cap(self, decode_tokens: int) -> int:
        """The prompt tokens a step beside `decode_tokens` decode tokens may carry: the cap, or
        down to half of it where that fills a token bucket the step would otherwise spill past
        (the device pads a step to its bucket, and padded tokens cost work on the CPU)."""
        cap = self.max_prefill_tokens_while_decoding
        filled = [b - decode_tokens for b in self.token_buckets if cap // 2 <= b - decode_tokens <= cap]
        return filled[-1] if filled else cap

    def _prompt_order(self, seq: Sequence) -> tuple[int, int, int]:
        """Prompts are served shortest remaining first, except one passed over for
        `PROMPT_SKIPS` steps, which goes first (oldest first): nothing starves."""
        starved = seq.prompt_skips >= self.PROMPT_SKIPS
        return (0 if starved else 1, seq.length - 1 - seq.num_computed, seq.arrival)

    def _admit_head(self, seq: Sequence, copies: list) -> bool:
        """Move the waiting queue's head into a slot (forking a sibling's prompt pages, or
        admitting it with its prefix-cache hits); False if it cannot run yet."""
        fork = self._fork_source(seq)
        if fork is False:  # the request's first completion is still prefilling its prompt
            return False
        if fork is not None:
            if not self.kv.fork(seq, fork, copies):
                return False
            self._take_slot(seq)
        elif not self._admit(seq, copies):
            return False
        self.waiting.popleft()
        return True

    def _last_token_pending(self, seq: Sequence) -> bool:
        """Its last token is being sampled on the device and will finish it by length: it
        sits this step out (async scheduling) instead of decoding a token that is dropped."""
        return seq.num_pending > 0 and (seq.num_generated >= seq.params.max_tokens or seq.length >= self.max_model_len)

    def _plan_chunk(self, seq: Sequence, budget: int, prefills: list, decodes: list, copies: list) -> int:
        """The next chunk of a prompt within the budget; the chunk that reaches the last prompt
        token also spends budget on that token (and its k speculative drafts): the sequence joins
        this step's decodes. Without room for that, the chunk stops one token short."""
        left = seq.length - 1 - seq.num_computed
        n = left if budget >= left + 1 + self.lookahead else min(budget, left - 1)
        if n <= 0:
            return budget
        if self.kv.local is not None and not self.kv.allocate_local(seq, seq.num_computed + n, copies):
            return budget  # the local pool is dry: the chunk waits for a decode to free its window
        prefills.append(PrefillChunk(seq, seq.num_computed, seq.num_computed + n))
        if n == left and self._reserve_lookahead(seq, copies):
            decodes.append(seq)  # its last token rides in the same row and samples
            return budget - n - 1 - self.lookahead
        return budget - n

    def _reserve_lookahead(self, seq: Sequence, copies: list) -> bool:
        """A sequence joining the decodes mid-step owns pages for the k positions a speculative
        step writes past its last token (the running ones got theirs in step 1), and with a
        local pool, the local page of its last token. Without them it waits: the next step's
        step 1 reserves them or preempts."""
        if not self.lookahead and self.kv.local is None:
            return True  # admission owns pages for every position through the last token
        return self.kv.allocate_slots(seq, self._decode_tokens(seq), copies)

    def _decode_tokens(self, seq: Sequence, num_steps: int = 1) -> int:
        """The tokens a decoding sequence owns pages for: through its k lookahead positions, but
        never past max_model_len. Positions past the page table write to the dummy page, and the
        tokens they would yield are dropped (`apply` finishes the request at max_model_len); without
        the cap, a request near max_model_len on a pool of max_pages_per_seq + 1 pages (the least
        resolve() accepts) could never get its lookahead and would preempt itself forever.
        Several decode steps in one call (num_steps) write num_steps - 1 positions past the last
        token, of which only those before max_tokens are kept: pages for those; the rest write
        to the dummy page."""
        ahead = self.lookahead
        if num_steps > 1:
            ahead = max(ahead, min(num_steps, self.tokens_left(seq)) - 1)
        return min(seq.length + ahead, self.max_model_len)

    def tokens_left(self, seq: Sequence) -> int:
        """Output tokens the sequence may still make: max_tokens and max_model_len allowing."""
        return min(seq.params.max_tokens - seq.num_generated, self.max_model_len - seq.length + 1)

    @staticmethod
    def _age(seq: Sequence) -> tuple[int, int]:
        """Oldest first: the n completions of a request share its arrival, so their index breaks
        the tie. Ordering by arrival alone fell back to the order in `running`, which changes on
        re-admission: two siblings could preempt each other forever."""
        return (seq.arrival, seq.index)

    @staticmethod
    def _fork_source(seq: Sequence) -> Sequence | None | bool:
        """For completion i > 0 of a request with n > 1 that has produced nothing yet: its first
        completion, once that one's prompt is in the cache (fork its pages: prefilled once);
        False while the first is still waiting or prefilling (wait for it); None otherwise
        (admit as usual, e.g. after the first has finished)."""
        lead = seq.leader
        if lead is None or seq.output_ids or lead.status is Status.FINISHED:
            return None
        if lead.status is Status.WAITING or lead.prefilling:
            return False
        return lead

    def _admit(self, seq: Sequence, copies: list) -> bool:
        if not self.kv.admit(seq, copies, keep_reserve=bool(self.running)):
            return False
        self._take_slot(seq)
        return True

    def _take_slot(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.slot = self.free_slots.pop(0)
        bisect.insort(self.running, seq, key=self._age)  # oldest first: `schedule` sorts nothing

    # -- state changes -----------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
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
            self.kv.free(seq)
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            self.free_slots.sort()
            seq.slot = None
        elif seq.status is Status.WAITING and seq in self.waiting:  # preempted while its token was pending
            self.waiting.remove(seq)
        seq.num_pending = 0  # a token still on the device is dropped; its page write is harmless
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish from outside the step (a stop string found by the detokenizer)."""
        if seq.status is not Status.FINISHED:
            self._finish(seq, reason)

    def dispatched(self, plan: StepPlan, decodes_pending: bool, num_steps: int = 1) -> None:
        """The runner has been handed the plan's work: prefilled tokens count as computed (and
        are offered to the prefix cache: any later reader of those pages runs after the write).
        decodes_pending: the decode step's tokens come later (`apply`); until then each
        decoded sequence holds one pending token (num_steps: a call of several decode steps), so
        the next step can be planned now."""
        local = self.kv.local is not None
        for chunk in plan.prefills:
            seq = chunk.seq
            if seq.status is Status.RUNNING:
                seq.num_computed = chunk.end
                self.kv.cache_computed(seq)
                if local:  # sliding layers: the pages the chunk moved past
                    self.kv.free_out_of_window(seq)
        if decodes_pending:
            running = Status.RUNNING
            for seq in plan.decodes:
                if seq.status is running:
                    seq.num_pending += num_steps
                    seq.num_computed = len(seq.prompt_ids) + len(seq.output_ids) + seq.num_pending - 1  # length - 1
                    if local:
                        self.kv.free_out_of_window(seq)

    def apply(
        self, seqs: list[Sequence], sampled: dict[str, list[tuple[int, dict[int, float] | None]]]
    ) -> list[Sequence]:
        """A step's sampled tokens arrive. sampled: request_id -> the new (token, logprobs)
        pairs, one from a plain decode, up to k+1 from a speculative step. A sequence finished
        since the step was dispatched drops its token; one preempted since keeps it (it is
        recomputed with it). Returns the sequences that got tokens (finished ones included)."""
        touched = []
        for seq in seqs:
            if seq.status is Status.FINISHED or seq.request_id not in sampled:
                continue
            touched.append(seq)
            for token, lp in sampled[seq.request_id]:
                if self._take(seq, token, lp):
                    break
            if seq.status is Status.RUNNING:  # a rejected speculative lookahead's pages go back
                self.kv.trim(seq)
        return touched

    def apply_ids(
        self, seqs: list[Sequence], ids: list, logprobs: list[dict[int, float] | None] | None = None
    ) -> list[Sequence]:
        """A plain step's tokens arrive, row i for seqs[i]: ids[i] one token (logprobs[i] its
        logprobs, when any row asked), or, from a call of several decode steps, a list of them
        in order. What `apply` does, without a dict of pairs per row: it runs for every row
        every step. Returns the sequences that got tokens (finished ones included)."""
        touched = []
        take, running, finished = self._take, Status.RUNNING, Status.FINISHED
        trim = self.lookahead > 0  # without a lookahead a plain step's pages are all kept
        for i, seq in enumerate(seqs):
            if seq.status is finished:
                continue
            touched.append(seq)
            tok = ids[i]
            if type(tok) is int:
                take(seq, tok, logprobs[i] if logprobs is not None else None)
            else:
                for t in tok:
                    if take(seq, t, None):
                        break
            if trim and seq.status is running:
                self.kv.trim(seq)
        return touched

    def _take(self, seq: Sequence, token: int, lp: dict[int, float] | None) -> bool:
        """One sampled token into the sequence (Sequence.append, inlined), finishing it by a
        stop token, its grammar's end, max_tokens or max_model_len. True when it finished."""
        seq.num_pending = max(0, seq.num_pending - 1)
        out = seq.output_ids
        out.append(token)
        if seq.history is not None:
            seq.history.add(token)
        if lp is not None:
            seq.logprobs.append(lp)
        n_out = len(out)
        if seq.status is Status.RUNNING:
            seq.num_computed = max(seq.num_computed, len(seq.prompt_ids) + n_out + seq.num_pending - 1)
        p = seq.params
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            self._finish(seq, "stop")
        elif seq.grammar is not None and seq.grammar.accept(token):  # the constrained output is complete
            self._finish(seq, "stop")
        elif n_out >= p.max_tokens or len(seq.prompt_ids) + n_out >= self.max_model_len:
            self._finish(seq, "length")
        else:
            return False
        return True

    def update(self, plan: StepPlan, sampled: dict[str, list[tuple[int, dict[int, float] | None]]]) -> list[Sequence]:
        """Apply a step run synchronously: its prefills, then its sampled tokens (`apply`)."""
        self.dispatched(plan, decodes_pending=False)
        return self.apply(plan.decodes, sampled)
