"""Huge pages for the CPU's big buffers: the kernel's own accounting (/proc/self/smaps) is the
oracle, and no value changes."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.runner import host_memory


def _supported() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) built with transparent huge pages. Their sysfs mode does not
    matter: MADV_COLLAPSE collapses under "never" too (seen on 6.18; Linux documents it)."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1) and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def _expect_huge(huge: int) -> None:
    """A mapping's huge-page bytes: none where unsupported, some where supported, unless this
    process has seen a collapse fail under memory pressure (host_memory.last_error)."""
    if not _supported():
        assert huge == 0
    elif host_memory.last_error() not in host_memory.TRANSIENT:
        assert huge > 0


def _mappings():
    """(start, stop, AnonHugePages bytes) of every mapping of this process, from /proc/self/smaps."""
    lo = hi = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
        elif head == "AnonHugePages:":
            yield lo, hi, int(line.split()[1]) * 1024


def _whole_runs(lo: int, hi: int) -> int:
    """Bytes of the 2 MiB-aligned runs that lie wholly inside [lo, hi)."""
    return max(0, hi // host_memory.HUGE_PAGE - -(-lo // host_memory.HUGE_PAGE)) * host_memory.HUGE_PAGE


def huge_bytes_in(start: int, stop: int) -> tuple[int, int]:
    """(huge-page bytes, the most there can be) over [start, stop).

    A buffer may span several mappings (an allocator may place it across two, and Linux keeps
    their boundary), and a huge page never crosses a mapping: only the whole 2 MiB runs inside
    each mapping's overlap with the buffer can be collapsed. Each mapping's AnonHugePages (which
    counts its huge pages anywhere, also outside the buffer) is capped at those runs."""
    huge = most = 0
    for lo, hi, h in _mappings():
        runs = _whole_runs(max(lo, start), min(hi, stop))
        huge, most = huge + min(h, runs), most + runs
    return huge, most


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`."""
    return next((huge for lo, hi, huge in _mappings() if lo <= address < hi), 0)


def test_a_big_array_lands_on_huge_pages_unchanged():
    x = jnp.arange(8 << 20, dtype=jnp.float32)  # 32 MiB
    x.block_until_ready()
    got = host_memory.advise_huge_pages({"w": x})
    if not _supported():
        assert got == 0
        return
    start = x.unsafe_buffer_pointer()
    runs = _whole_runs(start, start + x.nbytes)
    assert runs >= 15 << 21  # 32 MiB hold 15 or 16 whole 2 MiB runs, whatever their alignment
    # Linux collapses all of them, or (under memory pressure: CI once saw none collapsed by one
    # call) only some, for a transient reason, and then only the runs that succeeded are counted.
    assert got == runs or host_memory.last_error() in host_memory.TRANSIENT, host_memory.last_error()
    huge, most = huge_bytes_in(start, start + x.nbytes)
    # Every run that a mapping boundary does not cut is collapsed. Where the allocator placed the
    # buffer across several mappings (CI once saw 14 of 15 runs whole, the full suite 12), the runs
    # a boundary crosses cannot be (Linux reports them done); most of the buffer still can.
    assert most >= 8 << 20
    assert got - (runs - most) <= huge <= min(got, most)
    np.testing.assert_array_equal(np.asarray(x), np.arange(8 << 20, dtype=np.float32))


def test_a_run_that_fails_leaves_the_others_collapsed_and_uncounted():
    """One call over a range with a hole fails as a whole (ENOMEM: not mapped), as a run Linux
    cannot allocate or charge does; asked run by run, every other run is collapsed and counted."""
    if not _supported():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 12 * host_memory.HUGE_PAGE
    base = libc.mmap(None, size, 0x3, 0x22, -1, 0)  # PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    try:
        start = -(-base // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE  # 10 whole runs from here
        view = np.ctypeslib.as_array((ctypes.c_uint32 * (size // 4)).from_address(base))
        view[:] = np.arange(size // 4, dtype=np.uint32)
        hole = start + 4 * host_memory.HUGE_PAGE
        assert libc.munmap(hole, host_memory.HUGE_PAGE) == 0
        got = host_memory.collapse_range(start, 10 * host_memory.HUGE_PAGE)
        assert host_memory.last_error() in host_memory.TRANSIENT  # the one call failed (ENOMEM: a hole)
        if got < 9 * host_memory.HUGE_PAGE:  # memory pressure took some runs too: ask once more
            got = host_memory.collapse_range(start, 10 * host_memory.HUGE_PAGE)
        assert 0 < got <= 9 * host_memory.HUGE_PAGE
        huge, most = huge_bytes_in(start, start + 10 * host_memory.HUGE_PAGE)
        assert most == 9 * host_memory.HUGE_PAGE  # the hole is no mapping
        assert huge == got
        words = host_memory.HUGE_PAGE // 4
        off = (start - base) // 4
        kept = np.r_[off : off + 4 * words, off + 5 * words : off + 10 * words]
        np.testing.assert_array_equal(view[kept], kept.astype(np.uint32))
    finally:
        libc.munmap(base, size)


def test_small_arrays_and_the_switch_leave_memory_alone(monkeypatch):
    assert host_memory.advise_huge_pages([jnp.ones((1 << 18,), jnp.float32)]) == 0  # 1 MiB: no whole run
    monkeypatch.setenv(host_memory.ENV_DISABLE, "0")
    assert host_memory.advise_huge_pages([jnp.ones((16 << 20,), jnp.float32)]) == 0


def test_the_engine_pool_stays_on_huge_pages_while_serving(tok_model, monkeypatch):
    """The pool is donated to every step and written in place: after serving it is still at the
    same address, still on huge pages, and outputs equal an engine without them."""
    opts = dict(max_slots=4, page_size=16, max_model_len=256, num_pages=4096, token_buckets=(16, 64), warmup=False)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11]]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(tok_model[0], **opts)
    llm.runner.wait_for_huge_pages()  # collapsing runs in the background (warm-up waits for it)
    pool = llm.runner.target.kv[0][0]
    address = pool.unsafe_buffer_pointer()
    assert pool.nbytes >= 8 << 20
    _expect_huge(huge_bytes_at(address + pool.nbytes // 2))
    got = [o.token_ids for o in llm.generate(prompts, p)]
    pool = llm.runner.target.kv[0][0]
    assert pool.unsafe_buffer_pointer() == address
    _expect_huge(huge_bytes_at(address + pool.nbytes // 2))
    monkeypatch.setenv(host_memory.ENV_DISABLE, "0")
    plain = LLM(tok_model[0], **opts)
    assert got == [o.token_ids for o in plain.generate(prompts, p)]
