"""The KV manager: every page a request holds, and why.

It owns the page allocator and the radix tree of cached prefixes. The scheduler asks it
for what it needs in tokens — admit this request (reusing its cached prefix), make room
for n more tokens (plus a speculative lookahead), trim what a rejected draft left, free
everything — and never touches a page id's reference count. Copy-on-write happens here:
a page about to be written that another owner shares is replaced by a private copy, and
the (src, dst) pair goes into the step's copy list for the runner to execute first.

A request's block table is `seq.pages` (its pages in sequence order); the radix-tree node
it has pinned is kept here, keyed by request id, so requests hold no tree nodes.
Plain Python, no jax.
"""

from __future__ import annotations

from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.radix_cache import Node, RadixCache
from jaxserve.engine.request import Sequence


class KVManager:
    def __init__(self, allocator: PageAllocator, prefix_cache: RadixCache | None = None, watermark: float = 0.01):
        self.alloc = allocator
        self.prefix_cache = prefix_cache
        self.page_size = allocator.page_size
        self.watermark_pages = int(watermark * allocator.capacity)
        self._pinned: dict[str, Node] = {}  # request id -> the prefix-cache node it has locked

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    @property
    def num_free(self) -> int:
        return self.alloc.num_free

    def pages_for(self, num_tokens: int) -> int:
        return self.alloc.pages_for(num_tokens)

    def admit(self, seq: Sequence, copies: list[tuple[int, int]], keep_reserve: bool) -> bool:
        """Give a waiting request its cached prefix and pages for its whole current length,
        or nothing (and False) when the pool cannot hold it. keep_reserve leaves a small
        watermark free for the running requests' next tokens."""
        cache = self.prefix_cache
        # A request that asks for prompt logprobs computes every prompt position (cached KV
        # has no logits); it still offers its pages to the cache afterwards.
        match = cache.match(seq.all_ids[:-1]) if cache is not None and not seq.wants_prompt_logprobs else None
        cached_pages = match.pages if match else []
        cached_tokens = match.num_tokens if match else 0
        # Pages still to allocate, plus one when a shared partial page must be copied on write.
        need = self.alloc.pages_for(seq.length) - len(cached_pages) + (1 if cached_tokens % self.page_size else 0)
        reserve = self.watermark_pages if keep_reserve else 0
        if cache is not None and self.alloc.num_free < need + reserve:
            cache.evict(need + reserve - self.alloc.num_free)
        if self.alloc.num_free < need + reserve:
            if match:
                cache.release_match(match)
            return False
        seq.pages = list(cached_pages)
        seq.num_computed = cached_tokens
        if match:
            self._pinned[seq.request_id] = match.node
            cache.record(seq.length - 1, cached_tokens)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached_tokens, len(seq.prompt_ids))
        ok = self.allocate_slots(seq, seq.length, copies)
        assert ok, "admission reserved fewer pages than it checked for"
        return True

    def fork(self, seq: Sequence, src: Sequence, copies: list[tuple[int, int]]) -> bool:
        """Another completion of src's prompt (n > 1): seq shares src's pages of the prompt's
        computed tokens (their counts go up) and gets its own for the rest; the partly shared
        last page is copied on write. False (nothing taken) when the pool cannot hold it."""
        n = len(seq.prompt_ids) - 1
        shared = src.pages[: self.alloc.pages_for(n)]
        need = self.alloc.pages_for(seq.length) - len(shared) + (1 if n % self.page_size else 0)
        while self.alloc.num_free < need:
            if self.prefix_cache is None or not self.prefix_cache.evict(need - self.alloc.num_free):
                return False
        for p in shared:
            self.alloc.share(p)
        seq.pages, seq.num_computed = list(shared), n
        seq.num_cached_prompt_tokens = n
        ok = self.allocate_slots(seq, seq.length, copies)
        assert ok, "a fork reserved fewer pages than it checked for"
        return True

    def allocate_slots(self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Own enough pages for num_tokens (a speculative lookahead included by the caller),
        and make the pages about to be written private (copy-on-write into `copies`).
        False when the pool (after evicting cached prefixes) cannot: the caller preempts."""
        alloc, pages = self.alloc, seq.pages  # every decode row every step: attribute look-ups hoisted
        need = -(-num_tokens // self.page_size)  # alloc.pages_for
        while len(pages) < need:
            if not self._ensure_free_page():
                return False
            pages.append(alloc.allocate())
        refcount = alloc.refcount
        for i in range(seq.num_computed // self.page_size, len(pages)):
            page = pages[i]
            if refcount[page] > 1:  # alloc.is_shared
                if not self._ensure_free_page():
                    return False
                new = self.alloc.allocate()
                # A page that is itself this step's copy target is not filled yet (every copy
                # of a step reads the pool before any writes): copy from its source instead.
                src = next((a for a, b in reversed(copies) if b == page), page)
                copies.append((src, new))
                self.alloc.release(page)
                seq.pages[i] = new
        return True

    def _ensure_free_page(self) -> bool:
        """A page is free, evicting a cached prefix for it if the pool is dry."""
        return self.alloc.num_free > 0 or (self.prefix_cache is not None and self.prefix_cache.evict(1) > 0)

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the request's computed whole pages to the prefix cache (after every prefill
        chunk, so later arrivals hit sooner)."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq.all_ids[: seq.num_computed], seq.pages)

    def trim(self, seq: Sequence) -> None:
        """Give back pages past the sequence's length: a speculative lookahead the target
        did not accept."""
        keep = self.alloc.pages_for(seq.length)
        while len(seq.pages) > keep:
            self.alloc.release(seq.pages.pop())

    def free(self, seq: Sequence) -> None:
        """Give a request's pages back; with prefix caching, first offer its computed whole
        pages to the tree so the next request (or the next turn) can reuse them."""
        self.cache_computed(seq)
        node = self._pinned.pop(seq.request_id, None)
        if node is not None:
            self.prefix_cache.unlock(node)
        for p in seq.pages:
            self.alloc.release(p)
        seq.pages = []

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns pages freed."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def check(self, running: list[Sequence]) -> None:
        """Invariant: every page's reference count is exactly its owners (running requests
        and the prefix cache), and pinned nodes belong to running requests."""
        self.alloc.check()
        held: dict[int, int] = {}
        for seq in running:
            for p in seq.pages:
                held[p] = held.get(p, 0) + 1
        if self.prefix_cache is not None:
            for p in self.prefix_cache.pages():
                held[p] = held.get(p, 0) + 1
        for p in range(1, self.alloc.num_pages):
            assert self.alloc.refcount[p] == held.get(p, 0), (
                f"page {p}: count {self.alloc.refcount[p]}, owners {held.get(p, 0)}"
            )
        assert set(self._pinned) <= {s.request_id for s in running}, "a finished request still pins the prefix cache"
