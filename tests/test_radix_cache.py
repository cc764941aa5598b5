"""The radix tree against a plain reference (a set of cached page-aligned prefixes), and its
page accounting with the allocator. No JAX."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.radix_cache import RadixCache

pytestmark = pytest.mark.fast

PS = 4


def _lcp(a, b) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=22)  # tiny alphabet: lots of sharing


def _node_paths(cache: RadixCache) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """id(node) -> (its parent's token path, its own tokens), for every node in the tree."""
    out, stack = {}, [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            out[id(child)] = (path, tuple(child.tokens))
            stack.append((child, path + tuple(child.tokens)))
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["insert", "match", "unlock", "evict"]), tokens_st, st.integers(0, 8)), max_size=40
    )
)
def test_random_operations_against_reference(ops):
    alloc = PageAllocator(200, PS)
    cache = RadixCache(alloc)
    cached: set[tuple[int, ...]] = set()  # reference: page-aligned prefixes in the tree
    held = collections.Counter()  # pages held by "requests" (from inserts and matches)
    locks = []
    for op, toks, n in ops:
        if op == "insert":
            pages = [alloc.allocate() for _ in range(len(toks) // PS)]
            cache.insert(toks, pages)
            for k in range(1, len(pages) + 1):
                cached.add(tuple(toks[: k * PS]))
            for p in pages:  # the "request" finishes: its own references go
                alloc.release(p)
        elif op == "match":
            m = cache.match(toks)
            expect = max([_lcp(toks, p) for p in cached] or [0])
            assert m.num_tokens == expect, (toks, sorted(cached))
            assert len(m.pages) == -(-m.num_tokens // PS)
            locks.append(m)
            held.update(m.pages)
        elif op == "unlock" and locks:
            m = locks.pop(n % len(locks))
            cache.release_match(m)
            held.subtract(m.pages)
        elif op == "evict":
            locked_pages = {p for m in locks for p in m.pages}
            before = set(cache.pages())
            nodes_before = _node_paths(cache)
            cache.evict(n)
            nodes_after = _node_paths(cache)
            # (parent path, leaf tokens) of each evicted node, children before their parents
            evicted_paths = sorted(
                (v for i, v in nodes_before.items() if i not in nodes_after), key=lambda pl: -len(pl[0] + pl[1])
            )
            gone = before - set(cache.pages())
            assert not gone & locked_pages, "a locked page was evicted"
            for parent, leaf in evicted_paths:
                full = parent + leaf
                assert not any(len(q) > len(full) and q[: len(full)] == full for q in cached), "evicted a non-leaf"
                cached = {q for q in cached if not (len(q) > len(parent) and full[: len(q)] == q)}
            assert all(_in_tree(cache, q) for q in cached)
        # Accounting: every page is free, or referenced by the tree and/or requests, exactly.
        tree = collections.Counter(cache.pages())
        assert all(c == 1 for c in tree.values()), "a page twice in the tree"
        for p in range(1, alloc.num_pages):
            assert alloc.refcount[p] == tree[p] + held[p]
        alloc.check()
        free = set(alloc._free)
        assert not free & set(tree), "a page both free and in the tree"
        assert len(free) + len(set(tree) | {p for p, c in held.items() if c}) == alloc.capacity
    for m in locks:
        cache.release_match(m)
    cache.flush()
    assert alloc.num_free == alloc.capacity and not cache.pages()


def _in_tree(cache: RadixCache, prefix) -> bool:
    """Whether the page-aligned prefix is still a path in the tree (walk without side effects)."""
    node, pos = cache.root, 0
    while pos < len(prefix):
        child = node.children.get(tuple(prefix[pos : pos + PS]))
        if child is None:
            return False
        k = min(len(child.tokens), len(prefix) - pos)
        if tuple(prefix[pos : pos + k]) != child.tokens[:k]:
            return False
        pos += k
        node = child
    return True


def test_match_splits_inside_a_node_and_shares_a_partial_page():
    alloc = PageAllocator(20, PS)
    cache = RadixCache(alloc)
    pages = [alloc.allocate() for _ in range(3)]
    toks = list(range(12))
    cache.insert(toks, pages)
    m = cache.match([0, 1, 2, 3, 4, 5, 99, 99])
    assert m.num_tokens == 6 and m.pages == pages[:2]  # one whole page, then 2 tokens of the next
    assert alloc.refcount[pages[1]] == 3  # request + tree + the partial share
    assert cache.root.children[(0, 1, 2, 3)].pages == [pages[0]]  # split at the page boundary
    cache.release_match(m)


def test_insert_reports_existing_prefix_and_keeps_tree_pages():
    alloc = PageAllocator(20, PS)
    cache = RadixCache(alloc)
    a = [alloc.allocate() for _ in range(2)]
    assert cache.insert(list(range(8)), a) == 0
    b = [alloc.allocate() for _ in range(3)]
    assert cache.insert(list(range(12)), b) == 8  # first 8 tokens were there: tree keeps a
    assert sorted(cache.pages()) == sorted(a + [b[2]])
    for p in a + b:
        alloc.release(p)
    assert alloc.num_free == alloc.capacity - 3


def test_lru_eviction_keeps_locked_and_recent():
    alloc = PageAllocator(20, PS)
    cache = RadixCache(alloc)
    for base in (10, 20, 30):
        pages = [alloc.allocate()]
        cache.insert([base] * PS, pages)
        alloc.release(pages[0])
    m = cache.match([10] * PS + [1])  # lock 10
    cache.match([30] * PS + [1])  # touch 30 (then unlock it)
    cache.unlock(cache.root.children[(30,) * PS])
    for p in cache.root.children[(30,) * PS].pages:
        alloc.release(p)
    assert cache.evict(1) == 1
    assert set(cache.root.children) == {(10,) * PS, (30,) * PS}  # 20 was least recent
    assert cache.flush() == 1 and set(cache.root.children) == {(10,) * PS}  # 10 is locked
    cache.release_match(m)
    cache.flush()
    assert alloc.num_free == alloc.capacity


def test_a_match_ends_where_its_window_of_local_pages_is_present():
    """With a local pool (sliding layers, window 6): a hit is cut to the longest page-aligned
    length whose previous 5 positions' local pages are all in the tree; the cut match shares
    and locks only what it hands out, and a local page the tree lost is taken back from the
    next request that inserts the same tokens."""
    from jaxserve.engine.allocator import DUMMY_PAGE as D

    alloc, local = PageAllocator(16, PS), PageAllocator(16, PS)
    cache = RadixCache(alloc, local, window=6)
    tokens = list(range(100, 124))  # six pages
    full = [alloc.allocate() for _ in range(6)]
    own = [local.allocate() for _ in range(6)]
    cache.insert(tokens, full, [own[0], own[1], D, D, own[4], own[5]])
    m = cache.match(tokens + [1])  # resumes at 24: reads positions 19..23, pages 4 and 5
    assert (m.num_tokens, m.pages, m.local_pages) == (24, full, [own[0], own[1], D, D, own[4], own[5]])
    cache.release_match(m)
    m = cache.match(tokens[:16] + [1, 2, 3, 4])  # 16 would read pages 2 and 3 (gone); 12 page 2; 8 is whole
    assert (m.num_tokens, m.pages, m.local_pages) == (8, full[:2], own[:2])
    assert [local.refcount[p] for p in own[:2]] == [3, 3] and alloc.refcount[full[2]] == 2
    cache.release_match(m)
    again = [local.allocate(), local.allocate()]
    cache.insert(tokens[:16], full[:4], [D, D, *again])  # the same tokens with pages 2 and 3
    m = cache.match(tokens[:16] + [1])
    assert m.num_tokens == 16 and m.local_pages[2:] == again
    cache.release_match(m)
    for p in own + again:  # the requests' own references go; the tree's stay until it drops them
        local.release(p)
    for p in full:
        alloc.release(p)
    assert cache.evict_local(16) == 6 and local.num_free == local.capacity  # the nodes and full pages stay
    assert cache.match(tokens + [1]).num_tokens == 0  # every window is gone now
    assert cache.flush() == 6 and alloc.num_free == alloc.capacity
