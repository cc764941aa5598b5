"""The page allocator: reference counts, the reserved dummy page, never a page handed out twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.allocator import DUMMY_PAGE, OutOfPages, PageAllocator

pytestmark = pytest.mark.fast


def test_dummy_page_is_never_handed_out():
    a = PageAllocator(5, 4)
    pages = [a.allocate() for _ in range(4)]
    assert DUMMY_PAGE not in pages and sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPages):
        a.allocate()


def test_shared_page_returns_only_after_last_release():
    a = PageAllocator(4, 4)
    p = a.allocate()
    a.share(p)
    assert a.is_shared(p)
    a.release(p)
    assert a.num_free == 2 and not a.is_shared(p)
    a.release(p)
    assert a.num_free == 3
    with pytest.raises(AssertionError):
        a.release(p)


def test_pages_for_rounds_up():
    a = PageAllocator(4, 16)
    assert [a.pages_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_too_small_pool_rejected():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1, 16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 50)), max_size=200))
def test_random_ops_keep_counts_consistent(ops):
    a = PageAllocator(9, 4)
    owners: dict[int, int] = {}  # page -> expected count
    for op, k in ops:
        if op == "alloc":
            if a.num_free:
                p = a.allocate()
                assert p not in owners, "page handed out twice"
                owners[p] = 1
            else:
                with pytest.raises(OutOfPages):
                    a.allocate()
        elif owners:
            p = sorted(owners)[k % len(owners)]
            if op == "share":
                a.share(p)
                owners[p] += 1
            else:
                a.release(p)
                owners[p] -= 1
                if owners[p] == 0:
                    del owners[p]
        a.check()
        assert a.num_free == a.capacity - len(owners)
        for p, c in owners.items():
            assert a.refcount[p] == c
