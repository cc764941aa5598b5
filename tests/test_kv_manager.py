"""The KV manager without JAX: copy-on-write of shared pages, and random admit / grow /
trim / free / evict sequences that keep every page's reference count equal to its owners."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import SamplingParams, Sequence, Status

pytestmark = pytest.mark.fast


def test_copy_on_write_of_a_shared_partial_page():
    alloc = PageAllocator(8, 4)
    kv = KVManager(alloc)
    shared = alloc.allocate()
    alloc.share(shared)  # two owners, as after a fork or a prefix-cache hit
    seq = Sequence("x", [3] * 6, SamplingParams(max_tokens=4), 0, 0)
    seq.pages, seq.num_computed, seq.status, seq.slot = [shared], 2, Status.RUNNING, 0
    copies: list = []
    assert kv.allocate_slots(seq, seq.length, copies)
    assert copies == [(shared, seq.pages[0])] and seq.pages[0] != shared
    assert alloc.refcount[shared] == 1 and alloc.refcount[seq.pages[0]] == 1


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_pages=st.integers(6, 30),
    prefix_caching=st.booleans(),
    ops=st.lists(st.sampled_from(["admit", "grow", "grow", "trim", "free", "flush"]), max_size=80),
)
def test_random_operations_keep_page_ownership_exact(seed, num_pages, prefix_caching, ops):
    rng = random.Random(seed)
    alloc = PageAllocator(num_pages, 4)
    kv = KVManager(alloc, RadixCache(alloc) if prefix_caching else None)
    running: list[Sequence] = []
    for i, op in enumerate(ops):
        copies: list = []
        if op == "admit":
            seq = Sequence(
                f"r{i}", [rng.randrange(3, 5) for _ in range(rng.randrange(1, 14))], SamplingParams(max_tokens=8), 0, i
            )
            if kv.admit(seq, copies, keep_reserve=bool(running)):
                running.append(seq)
                assert len(seq.pages) == kv.pages_for(seq.length)
            else:
                assert not seq.pages
        elif op == "grow" and running:
            seq = rng.choice(running)
            seq.num_computed = seq.length - 1  # what the last step wrote
            seq.output_ids.append(rng.randrange(3, 5))
            lookahead = rng.choice([0, 3])
            if kv.allocate_slots(seq, seq.length + lookahead, copies):
                assert len(seq.pages) >= kv.pages_for(seq.length + lookahead)
                written = seq.num_computed // 4
                assert all(alloc.refcount[p] == 1 for p in seq.pages[written:]), "a shared page would be written"
            kv.cache_computed(seq)
        elif op == "trim" and running:
            seq = rng.choice(running)
            kv.trim(seq)
            assert len(seq.pages) <= kv.pages_for(seq.length)
        elif op == "free" and running:
            seq = running.pop(rng.randrange(len(running)))
            kv.free(seq)
            assert not seq.pages
        elif op == "flush":
            kv.flush_prefix_cache()
        for src, dst in copies:
            assert src != dst and alloc.refcount[dst] >= 1
        kv.check(running)
    for seq in running:
        kv.free(seq)
    kv.flush_prefix_cache()
    kv.check([])
    assert alloc.num_free == alloc.capacity, "pages leaked"


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_pages=st.integers(8, 30),
    local_pages=st.integers(4, 12),
    window=st.integers(1, 9),
    prefix_caching=st.booleans(),
    ops=st.lists(st.sampled_from(["admit", "step", "step", "step", "free", "flush"]), max_size=80),
)
def test_a_local_pool_keeps_each_window_and_exact_ownership(seed, num_pages, local_pages, window, prefix_caching, ops):
    """Sliding-window layers' pool (as the scheduler drives it): a step computes a prompt chunk
    (local pages for it only) or a decode token (with a lookahead, preempted when a pool is dry);
    after every step the local pages the next query reads (its window) are held, nothing
    before the window is, and every page of both pools has exactly its owners' count."""
    rng = random.Random(seed)
    alloc, local = PageAllocator(num_pages, 4), PageAllocator(local_pages, 4)
    cache = RadixCache(alloc, local, window) if prefix_caching else None
    kv = KVManager(alloc, cache, local=local, window=window)
    running: list[Sequence] = []
    copies: list = []
    for i, op in enumerate(ops):
        if i % 4 == 0:  # a step's copy list spans several admissions and allocations, both pools'
            copies = []
        if op == "admit":
            prompt = [rng.randrange(3, 5) for _ in range(rng.randrange(1, 20))]
            seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=8), 0, i)
            if kv.admit(seq, copies, keep_reserve=bool(running)):
                running.append(seq)
        elif op == "step" and running:
            seq = rng.choice(running)
            if seq.prefilling:
                end = seq.num_computed + rng.randrange(1, seq.length - seq.num_computed)
                if kv.allocate_local(seq, end, copies):
                    seq.num_computed = end
                    kv.cache_computed(seq)
            elif kv.allocate_slots(seq, seq.length + rng.choice([0, 2]), copies):
                seq.output_ids.append(rng.randrange(3, 5))
                seq.num_computed = seq.length - 1
                kv.trim(seq)
            else:  # preempted
                kv.free(seq)
                running.remove(seq)
            kv.free_out_of_window(seq)
        elif op == "free" and running:
            kv.free(running.pop(rng.randrange(len(running))))
        elif op == "flush":
            kv.flush_prefix_cache()
        for c in copies:
            assert c[0] != c[1]
        kv.check(running)
        for seq in running:
            assert kv._window_held(seq, seq.num_computed), "a page the next query reads is gone"
            before = max(0, seq.num_computed - window + 1) // 4
            assert all(p == 0 for p in seq.local_pages[:before]), "a page out of the window is held"
    for seq in running:
        kv.free(seq)
    kv.flush_prefix_cache()
    kv.check([])
    assert alloc.num_free == alloc.capacity and local.num_free == local.capacity, "pages leaked"


def test_two_hits_on_one_partial_page_copy_it_in_both_pools_in_one_step():
    """Two requests admitted in the same step, both hitting a cached page partly: each gets
    private copies of that page in the full pool (pairs) and the local one ((src, dst, "local")),
    all in the step's one copy list."""
    alloc, local = PageAllocator(16, 4), PageAllocator(16, 4)
    kv = KVManager(alloc, RadixCache(alloc, local, 8), local=local, window=8)
    first = Sequence("a", list(range(5, 15)), SamplingParams(max_tokens=4), 0, 0)
    assert kv.admit(first, [], keep_reserve=False)
    assert kv.allocate_local(first, 9, [])
    first.num_computed = 9
    kv.cache_computed(first)  # two whole pages in the tree, both pools'
    kv.free(first)
    copies: list = []
    seqs = [
        Sequence(f"b{i}", list(range(5, 11)) + [99, 98, 97], SamplingParams(max_tokens=4), 0, 1 + i) for i in range(2)
    ]
    for seq in seqs:
        assert kv.admit(seq, copies, keep_reserve=False) and seq.num_computed == 6
    assert sorted(len(c) for c in copies) == [2, 2, 3, 3]
    assert {seq.local_pages[1] for seq in seqs} == {c[1] for c in copies if len(c) == 3}
    kv.check(seqs)
    for seq in seqs:
        kv.free(seq)
    kv.flush_prefix_cache()
    kv.check([])
    assert alloc.num_free == alloc.capacity and local.num_free == local.capacity
