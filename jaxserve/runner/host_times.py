"""The engine thread's CPU time by phase of a step (`jaxserve bench latency --host`).

On an accelerator every microsecond the host spends between two steps is a microsecond the chip
may wait, so the host's work per step is measured as CPU time of the engine's thread
(`time.thread_time`: waiting for the device costs none), split by phase. Off by default: the
engine and the runner time nothing unless a `HostTimes` is attached.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

PHASES = (
    "schedule",  # the scheduler's plan: admission, pages, the token budget
    "build",  # rows and the step batch's arrays
    "dispatch",  # the executable call: arguments handed to the device
    "resolve",  # reading the sampled ids and applying them (stops, pages)
    "detokenize",  # text, stop strings and each request's output
)


class HostTimes:
    """CPU seconds of the calling thread by phase, summed over steps."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.seconds[name] += time.thread_time() - t0

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)


def phase(times: HostTimes | None, name: str):
    """`times.phase(name)`, or nothing when no one is timing."""
    return times.phase(name) if times is not None else nullcontext()
