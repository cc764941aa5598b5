"""The KV manager: every page a request holds, and why.

It owns the page allocator and the radix tree of cached prefixes. The scheduler asks it
for what it needs in tokens — admit this request (reusing its cached prefix), make room
for n more tokens (plus a speculative lookahead), trim what a rejected draft left, free
everything — and never touches a page id's reference count. Copy-on-write happens here:
a page about to be written that another owner shares is replaced by a private copy, and
the (src, dst) pair goes into the step's copy list for the runner to execute first.

A request's block table is `seq.pages` (its pages in sequence order); the radix-tree node
it has pinned is kept here, keyed by request id, so requests hold no tree nodes.

Sliding-window layers (Gemma 3's local layers, every layer of Mistral) have a page pool of
their own, `local`, and a request a second block table, `seq.local_pages`, index for index
with `seq.pages`. A sliding layer's query at position q reads keys q - W + 1 .. q only, so a
local page is freed as soon as every position on it is older than what the request's next
query can see (position < num_computed - W + 1; a chunk starting at s needs keys from
s - W + 1): its entry becomes the dummy page, which the kernels mask. Local pages are also
allocated lazily, only for the positions a step computes (`allocate_slots`' `local_end`), so
a long request holds about W / page_size + 1 local pages plus its chunk's, not its context's.
Plain Python, no jax.
"""

from __future__ import annotations

from jaxserve.engine.allocator import DUMMY_PAGE, PageAllocator
from jaxserve.engine.radix_cache import Node, RadixCache
from jaxserve.engine.request import Sequence

LOCAL = "local"  # the third element of a local page copy (src, dst, LOCAL); full ones are pairs


class KVManager:
    def __init__(
        self,
        allocator: PageAllocator,
        prefix_cache: RadixCache | None = None,
        watermark: float = 0.01,
        local: PageAllocator | None = None,
        window: int | None = None,
    ):
        """local, window: the sliding layers' page pool and their window W (None: every layer
        keeps every page, as in a model without sliding layers)."""
        self.alloc = allocator
        self.prefix_cache = prefix_cache
        self.page_size = allocator.page_size
        self.watermark_pages = int(watermark * allocator.capacity)
        self._pinned: dict[str, Node] = {}  # request id -> the prefix-cache node it has locked
        self.local = local
        self.window = window
        if (local is None) != (window is None):
            raise ValueError("a local page pool needs its window, and a window its pool")

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
        # a shared partial local page is copied on write too
        if self.alloc.num_free < need + reserve or (cached_tokens % self.page_size and not self._local_room()):
            if match:
                cache.release_match(match)
            return False
        seq.pages = list(cached_pages)
        seq.local_pages = list(match.local_pages) if match and self.local is not None else []
        seq.num_computed = cached_tokens
        if match:
            self._pinned[seq.request_id] = match.node
            cache.record(seq.length - 1, cached_tokens)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached_tokens, len(seq.prompt_ids))
        ok = self.allocate_slots(seq, seq.length, copies, local_end=cached_tokens)
        assert ok, "admission reserved fewer pages than it checked for"
        return True

    def fork(self, seq: Sequence, src: Sequence, copies: list[tuple[int, int]]) -> bool:
        """Another completion of src's prompt (n > 1): seq shares src's pages of the prompt's
        computed tokens (their counts go up) and gets its own for the rest; the partly shared
        last page is copied on write. False (nothing taken) when the pool cannot hold it."""
        n = len(seq.prompt_ids) - 1
        if self.local is not None and not self._window_held(src, n):
            return self.admit(seq, copies, keep_reserve=True)  # src freed what the fork would read
        shared = src.pages[: self.alloc.pages_for(n)]
        need = self.alloc.pages_for(seq.length) - len(shared) + (1 if n % self.page_size else 0)
        while self.alloc.num_free < need:
            if self.prefix_cache is None or not self.prefix_cache.evict(need - self.alloc.num_free):
                return False
        if n % self.page_size and not self._local_room():
            return False
        for p in shared:
            self.alloc.share(p)
        seq.pages, seq.num_computed = list(shared), n
        if self.local is not None:
            seq.local_pages = list(src.local_pages[: len(shared)])
            for p in seq.local_pages:
                if p != DUMMY_PAGE:
                    self.local.share(p)
        seq.num_cached_prompt_tokens = n
        ok = self.allocate_slots(seq, seq.length, copies, local_end=n)
        assert ok, "a fork reserved fewer pages than it checked for"
        return True

    def _window_held(self, seq: Sequence, end: int) -> bool:
        """seq still holds the local pages a query at `end` reads."""
        lo = max(0, end - self.window + 1) // self.page_size
        table = seq.local_pages[lo : self.alloc.pages_for(end)]
        return len(table) == self.alloc.pages_for(end) - lo and DUMMY_PAGE not in table

    def allocate_slots(
        self, seq: Sequence, num_tokens: int, copies: list[tuple[int, int]], local_end: int | None = None
    ) -> bool:
        """Own enough pages for num_tokens (a speculative lookahead included by the caller),
        and make the pages about to be written private (copy-on-write into `copies`).
        With a local pool, local pages through local_end (default num_tokens): admission takes
        only full pages, a prompt's local ones come chunk by chunk (`allocate_local`).
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
                src = next((c[0] for c in reversed(copies) if len(c) == 2 and c[1] == page), page)
                copies.append((src, new))
                self.alloc.release(page)
                seq.pages[i] = new
        if self.local is not None:
            return self.allocate_local(seq, num_tokens if local_end is None else local_end, copies)
        return True

    def allocate_local(self, seq: Sequence, end: int, copies: list) -> bool:
        """Free the local pages that fell out of the window of the next query (at num_computed),
        then own local pages through position end - 1, the ones about to be written private
        (copies tagged LOCAL). False when the local pool cannot (after dropping the prefix
        cache's local pages): the caller preempts or waits."""
        ps, start = self.page_size, seq.num_computed
        lo = self.free_out_of_window(seq)
        table = seq.local_pages
        n = self.alloc.pages_for(end)
        table.extend([DUMMY_PAGE] * (n - len(table)))
        for i in range(max(lo, start // ps), n):
            page = table[i]
            if page != DUMMY_PAGE and not self.local.is_shared(page):
                continue
            if not self._ensure_free_local():
                return False
            new = self.local.allocate()
            if page != DUMMY_PAGE:  # shared (a prefix-cache hit, a fork): copied on write
                src = next((c[0] for c in reversed(copies) if len(c) == 3 and c[1] == page), page)
                copies.append((src, new, LOCAL))
                self.local.release(page)
            else:
                assert i * ps >= start, f"local page {i} was freed but position {start} still reads it"
            table[i] = new
        return True

    def free_out_of_window(self, seq: Sequence) -> int:
        """Give back the local pages every future query of seq is past (each position on them
        < num_computed - W + 1); returns the first page still kept. A no-op without a local pool.
        Called as soon as a step that advanced num_computed is dispatched: a later step reusing
        a freed page runs after it on the device."""
        if self.local is None:
            return 0
        lo = max(0, seq.num_computed - self.window + 1) // self.page_size
        table = seq.local_pages
        for i in range(min(lo, len(table))):
            if table[i] != DUMMY_PAGE:
                self.local.release(table[i])
                table[i] = DUMMY_PAGE
        return lo

    def _local_room(self) -> bool:
        """No local pool, or a free page in it."""
        return self.local is None or self._ensure_free_local()

    def _ensure_free_local(self) -> bool:
        """A local page is free, dropping the prefix cache's local pages for it if needed (a
        thirty-second of the pool at a time: each drop walks the tree)."""
        if self.local.num_free > 0:
            return True
        batch = max(1, self.local.capacity // 32)
        return self.prefix_cache is not None and self.prefix_cache.evict_local(batch) > 0

    def _ensure_free_page(self) -> bool:
        """A page is free, evicting a cached prefix for it if the pool is dry."""
        return self.alloc.num_free > 0 or (self.prefix_cache is not None and self.prefix_cache.evict(1) > 0)

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the request's computed whole pages to the prefix cache (after every prefill
        chunk, so later arrivals hit sooner)."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq.all_ids[: seq.num_computed], seq.pages, seq.local_pages)

    def trim(self, seq: Sequence) -> None:
        """Give back pages past the sequence's length: a speculative lookahead the target
        did not accept."""
        keep = self.alloc.pages_for(seq.length)
        while len(seq.pages) > keep:
            self.alloc.release(seq.pages.pop())
        while len(seq.local_pages) > keep:
            p = seq.local_pages.pop()
            if p != DUMMY_PAGE:
                self.local.release(p)

    def free(self, seq: Sequence) -> None:
        """Give a request's pages back; with prefix caching, first offer its computed whole
        pages to the tree so the next request (or the next turn) can reuse them."""
        self.cache_computed(seq)
        node = self._pinned.pop(seq.request_id, None)
        if node is not None:
            self.prefix_cache.unlock(node)
        for p in seq.pages:
            self.alloc.release(p)
        for p in seq.local_pages:
            if p != DUMMY_PAGE:
                self.local.release(p)
        seq.pages, seq.local_pages = [], []

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
        if self.local is not None:
            self.local.check()
            held = {}
            tree = self.prefix_cache.local_page_ids() if self.prefix_cache is not None else []
            for p in [p for s in running for p in s.local_pages if p != DUMMY_PAGE] + tree:
                held[p] = held.get(p, 0) + 1
            for p in range(1, self.local.num_pages):
                assert self.local.refcount[p] == held.get(p, 0), (
                    f"local page {p}: count {self.local.refcount[p]}, owners {held.get(p, 0)}"
                )

    def local_pages_held(self, seq: Sequence) -> int:
        """The local pages a request holds now (freed ones not counted)."""
        return sum(p != DUMMY_PAGE for p in seq.local_pages)
