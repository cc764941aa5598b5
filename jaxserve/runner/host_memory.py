"""The CPU backend's big buffers (weights, KV page pool) on 2 MiB transparent huge pages.

Why: on the CPU a decode step streams every weight and reads the live KV pages, scattered over
the pool. On 4 KiB pages every 4 KiB of that is a TLB miss, and in a virtual machine each miss is
a two-level page walk. XLA allocates its buffers with malloc, so they land on 4 KiB pages unless
the system's THP mode is "always" (it is usually "madvise"). After allocation we ask Linux to
collapse each buffer's whole 2 MiB-aligned runs into huge pages (madvise MADV_COLLAPSE, Linux 6.1+).
This changes no value, only how memory is mapped; where the call is unsupported (another OS, an
older kernel, a kernel without THP) nothing happens. The sysfs THP mode does not matter: the call
collapses under "never" too.

Measured on the development VM (docs/benchmarks.md): paged attention over a 512 MiB pool
3.5-8% faster, the batch-32 decode step of the 56.4M bench model 2% faster, its batch-1 step
about 12% (2.6-3.6 ms against 3.4-3.9 ms, three pairs of processes, 2026-12-04).

The buffers must stay where they are: the engine donates its KV pool to every step and XLA
writes the result in place, so the pool keeps its address (and its huge pages) while serving.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
from collections.abc import Iterable

import jax

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # <linux/mman.h>
ENV_DISABLE = "JAXSERVE_HUGE_PAGES"  # "0" turns it off


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()
_warned = False
_last_error = 0
RETRIES = 3  # EAGAIN: a page was briefly locked, pinned or off the LRU lists
TRANSIENT = (errno.EAGAIN, errno.EBUSY, errno.ENOMEM)  # retry-worthy or memory pressure


def last_error() -> int:
    """errno of the last failed collapse in this process (0 if none): why a buffer stayed on
    small pages."""
    return _last_error


def _buffers(tree) -> Iterable[tuple[int, int]]:
    """(address, bytes) of every CPU buffer in a pytree of arrays (nnx variables unwrapped)."""
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "get_value"):
            leaf = leaf.get_value()
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            data = shard.data
            if data.devices().pop().platform != "cpu":
                continue
            try:
                yield data.unsafe_buffer_pointer(), data.nbytes
            except (RuntimeError, ValueError):  # not a plain host buffer
                continue


def _collapse(lo: int, hi: int) -> int:
    """One MADV_COLLAPSE over [lo, hi), retried on EAGAIN; 0 if every run was collapsed, else the
    errno (also kept for last_error)."""
    global _last_error
    for _ in range(RETRIES):
        if _MADVISE(lo, hi - lo, MADV_COLLAPSE) == 0:
            return 0
        _last_error = err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    return err


def collapse_range(address: int, nbytes: int) -> int:
    """Collapse the whole 2 MiB pages inside [address, address + nbytes); returns the bytes
    collapsed (0 if none fit or the call is unsupported).

    One call covers the range. Linux stops at the first run it cannot collapse and reports only
    the failure (a huge page it could not allocate or charge under memory pressure, a page briefly
    pinned), so then each run is asked for alone and only the runs that succeed are counted. Linux
    also succeeds without collapsing a run that a mapping boundary crosses, so the kernel may
    collapse up to one run less per boundary than is returned."""
    global _warned
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if _MADVISE is None or hi <= lo:
        return 0
    err = _collapse(lo, hi)
    if not err:
        return hi - lo
    done = 0
    if err in TRANSIENT:
        done = sum(HUGE_PAGE for run in range(lo, hi, HUGE_PAGE) if not _collapse(run, run + HUGE_PAGE))
    if done < hi - lo and not _warned:
        _warned = True
        log.info(
            "huge pages: %d of %d MiB collapsed (madvise MADV_COLLAPSE: %s); the rest stays on small pages",
            done >> 20,
            (hi - lo) >> 20,
            os.strerror(_last_error),
        )
    return done


def _ranges(tree) -> list[tuple[int, int]]:
    """_buffers(tree), or none when JAXSERVE_HUGE_PAGES=0."""
    return list(_buffers(tree)) if os.environ.get(ENV_DISABLE, "1") != "0" else []


def advise_huge_pages(tree) -> int:
    """Put the CPU buffers of `tree` on huge pages where they span whole 2 MiB runs; returns the
    bytes collapsed. Off with JAXSERVE_HUGE_PAGES=0; never raises."""
    return sum(collapse_range(a, n) for a, n in _ranges(tree))


def advise_huge_pages_in_background(tree) -> threading.Thread:
    """advise_huge_pages on a daemon thread, started now; join it to wait.

    Collapsing copies the memory into fresh huge pages: about 2.7 ms per MiB on the development VM
    (1 s for the bench model's weights and a batch-32 pool), time that the engine's warm-up
    compiles hide. It is safe while the buffers are in use: Linux swaps the mappings atomically
    (it is what khugepaged does to running processes), and madvise releases the GIL."""
    ranges = _ranges(tree)  # read here: the arrays may be donated later

    def collapse_all() -> None:
        for address, nbytes in ranges:
            collapse_range(address, nbytes)

    t = threading.Thread(target=collapse_all, name="huge-pages", daemon=True)
    t.start()
    return t
