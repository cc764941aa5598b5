"""The page allocator: fixed-size KV pages with reference counts. Plain Python.

Page 0 is reserved: padded slots and padded prefill tokens write into it, so the device
step never needs a branch for "inactive". A page shared by several sequences (a prefix
cache hit, a fork) has a count above one and must be copied before anyone writes into it.
"""

from __future__ import annotations

from collections import deque

DUMMY_PAGE = 0


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.refcount[DUMMY_PAGE] = 1  # never handed out
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that requests can use (all but the dummy)."""
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPages("no free KV pages")
        page = self._free.popleft()
        assert self.refcount[page] == 0, f"page {page} handed out twice"
        self.refcount[page] = 1
        return page

    def share(self, page: int) -> None:
        assert page != DUMMY_PAGE and self.refcount[page] > 0, f"sharing unowned page {page}"
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        assert page != DUMMY_PAGE and self.refcount[page] > 0, f"releasing free page {page}"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)

    def is_shared(self, page: int) -> bool:
        return self.refcount[page] > 1

    def check(self) -> None:
        """Invariant: every page is either free (count 0, in the free list once) or owned."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is in the free list twice"
        assert DUMMY_PAGE not in free
        for p in range(1, self.num_pages):
            assert (self.refcount[p] == 0) == (p in free), f"page {p}: count {self.refcount[p]}, free={p in free}"
