"""Huge pages for the CPU's big buffers: the kernel's own accounting (/proc/self/smaps) is the
oracle, and no value changes."""

from __future__ import annotations

import platform
import sys

import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.runner import host_memory


def _supported() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not set to "never"."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and "[never]" not in mode


def _mappings():
    """(start, stop, AnonHugePages bytes) of every mapping of this process, from /proc/self/smaps."""
    lo = hi = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
        elif head == "AnonHugePages:":
            yield lo, hi, int(line.split()[1]) * 1024


def huge_bytes_in(start: int, stop: int) -> int:
    """Huge-page bytes of the mappings that overlap [start, stop), each counted for at most its
    overlap: a buffer may span several mappings (madvise splits one at the advised range's edges,
    and an allocator may have placed the buffer across two)."""
    return sum(min(huge, max(0, min(hi, stop) - max(lo, start))) for lo, hi, huge in _mappings())


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
    assert got >= 30 << 20  # every whole 2 MiB run inside 32 MiB, whatever its alignment
    assert huge_bytes_in(x.unsafe_buffer_pointer(), x.unsafe_buffer_pointer() + x.nbytes) >= got
    np.testing.assert_array_equal(np.asarray(x), np.arange(8 << 20, dtype=np.float32))


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
    assert (huge_bytes_at(address + pool.nbytes // 2) > 0) == _supported()
    got = [o.token_ids for o in llm.generate(prompts, p)]
    pool = llm.runner.target.kv[0][0]
    assert pool.unsafe_buffer_pointer() == address
    assert (huge_bytes_at(address + pool.nbytes // 2) > 0) == _supported()
    monkeypatch.setenv(host_memory.ENV_DISABLE, "0")
    plain = LLM(tok_model[0], **opts)
    assert got == [o.token_ids for o in plain.generate(prompts, p)]
