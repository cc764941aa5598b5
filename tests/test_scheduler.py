"""The continuous-batching scheduler, without JAX: random admit/step/finish/abort/preempt
sequences keep page ownership exact, and every request finishes with the right length."""

from __future__ import annotations

import collections
import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import SamplingParams, Sequence, Status
from jaxserve.engine.scheduler import Scheduler


def _check_ownership(s: Scheduler):
    s.kv.check(s.running)
    s.kv.alloc.check()
    held = collections.Counter(p for seq in s.running for p in seq.pages)
    if s.kv.prefix_cache is not None:
        held.update(s.kv.prefix_cache.pages())
    for p in range(1, s.kv.alloc.num_pages):
        assert s.kv.alloc.refcount[p] == held.get(p, 0), f"page {p}"
    assert s.kv.alloc.num_free == s.kv.alloc.capacity - len(held)
    slots = [seq.slot for seq in s.running]
    assert len(set(slots)) == len(slots) and sorted(slots + s.free_slots) == list(range(s.max_slots))
    for seq in s.running:
        assert len(seq.pages) >= s.kv.alloc.pages_for(seq.num_computed)
    for seq in s.waiting:
        assert not seq.pages and seq.slot is None


def _fake_step(s: Scheduler, rng: random.Random) -> None:
    """What the engine would do: fill prefills, sample one token per decoding sequence."""
    plan = s.schedule()
    for seq in plan.decodes:
        assert len(seq.pages) >= s.kv.alloc.pages_for(seq.length + s.lookahead), "decode without pages for its tokens"
        assert seq.status is Status.RUNNING
    for c in plan.prefills:
        assert c.seq.num_computed == c.start < c.end <= c.seq.length - 1
    # One token budget for the whole step: a decode token per sampling row, then prompt chunks.
    assert sum(plan.num_scheduled_tokens.values()) <= s.max_num_batched_tokens
    s.update(
        plan,
        {
            seq.request_id: [(rng.randrange(3, 50), None) for _ in range(rng.randint(1, 1 + s.lookahead))]
            for seq in plan.decodes
        },
    )


@settings(max_examples=500, deadline=None)
# Found by hypothesis: a request whose prompt is all in the prefix cache goes straight to
# decoding and must still reserve its speculative lookahead pages.
@example(seed=0, num_pages=12, slots=1, ops=["add"] * 5, prefix_caching=True, lookahead=3)
@given(
    seed=st.integers(0, 10**6),
    num_pages=st.integers(12, 40),
    slots=st.integers(1, 6),
    ops=st.lists(st.sampled_from(["add", "step", "step", "step", "abort"]), min_size=1, max_size=120),
    prefix_caching=st.booleans(),
    lookahead=st.sampled_from([0, 0, 3]),
)
def test_random_workloads_keep_invariants_and_finish(seed, num_pages, slots, ops, prefix_caching, lookahead):
    rng = random.Random(seed)
    page_size, max_len = 4, 40
    alloc = PageAllocator(num_pages, page_size)
    kv = KVManager(alloc, RadixCache(alloc) if prefix_caching else None)
    s = Scheduler(kv, slots, max_len, max_num_batched_tokens=24, eos_token_ids=[1], lookahead=lookahead)
    seqs: list[Sequence] = []
    for op in ops:
        if op == "add":
            plen = rng.randrange(1, 20)
            seq = Sequence(
                f"r{len(seqs)}",
                [rng.randrange(3, 5) for _ in range(plen)],  # small alphabet: shared prefixes
                SamplingParams(max_tokens=rng.randrange(1, max_len - plen + 1), ignore_eos=True),
                seed=0,
                arrival=len(seqs),
            )
            seqs.append(seq)
            s.add(seq)
        elif op == "abort" and seqs:
            s.abort(rng.choice(seqs).request_id)
        else:
            _fake_step(s, rng)
        _check_ownership(s)
    for _ in range(2000):  # drain: everything finishes, nothing starves
        if not s.has_unfinished():
            break
        _fake_step(s, rng)
        _check_ownership(s)
    assert not s.has_unfinished()
    if s.kv.prefix_cache is not None:
        s.kv.prefix_cache.flush()
    assert s.kv.alloc.num_free == s.kv.alloc.capacity
    for seq in seqs:
        assert seq.status is Status.FINISHED
        if seq.finish_reason == "length":
            assert len(seq.output_ids) == seq.params.max_tokens


def test_preempts_newest_and_requeues_it_first():
    s = Scheduler(KVManager(PageAllocator(7, 4)), 3, 24, max_num_batched_tokens=64)
    a = Sequence("a", [5] * 7, SamplingParams(max_tokens=10, ignore_eos=True), 0, 0)
    b = Sequence("b", [5] * 7, SamplingParams(max_tokens=10, ignore_eos=True), 0, 1)
    c = Sequence("c", [5] * 7, SamplingParams(max_tokens=10, ignore_eos=True), 0, 2)
    for x in (a, b, c):
        s.add(x)
    rng = random.Random(0)
    preempted = []
    for _ in range(6):
        plan = s.schedule()
        preempted += [p.request_id for p in plan.preempted]
        s.update(plan, {q.request_id: [(7, None)] for q in plan.decodes})
        _check_ownership(s)
    assert preempted and preempted[0] == "c"
    assert s.waiting[0].request_id in preempted
    while s.has_unfinished():
        _fake_step(s, rng)
    assert [len(x.output_ids) for x in (a, b, c)] == [10, 10, 10]
