"""Device-side timing for `jaxserve bench device`: the accelerator's own clock, read from a profile.

A wall-clock timer around a blocked call counts the launch, the host's wait and the Python around
it; on a GPU those are tens of microseconds, the whole time of a decode kernel. So a section runs
under one `jax.profiler.trace` (perfetto JSON too, for reading by eye), each timed call inside a
named `TraceAnnotation` on the host, and afterwards the device's events (a GPU's kernel streams,
a TPU's ops) that fall inside that call's window are merged into busy intervals: the call's
device time is how long the device was busy, gaps excluded. One trace per section, not per call,
because starting and stopping the profiler costs about a second.

Where the trace has no device events (the CPU, whose XLA ops run on host threads; a profiler
that fails to start) the wall time of the same calls is used instead, and every figure says which
clock it came from: ``"timing": "device-trace"`` or ``"wall-clock"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import time
from typing import Iterator

DEVICE_TRACE, WALL_CLOCK = "device-trace", "wall-clock"
_TAG = "jaxserve-timed:"  # the prefix of our host annotations
# Lines of a device plane that repeat or summarise the kernels (XLA's derived timelines).
_DERIVED = ("XLA Modules", "Steps", "Framework", "Source code", "TensorFlow", "Launch Stats", "_counters_")


def busy_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals: overlapping kernels on two streams
    count once, gaps between them not at all."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _device_lines(planes) -> list[tuple[float, float]]:
    """Every device event's (start, end) ns: a GPU plane's stream lines, a TPU's op lines, never
    the derived lines that summarise them."""
    out = []
    for plane in planes:
        if not plane.name.startswith("/device:") or plane.name.startswith("/device:CPU"):
            continue
        lines = [ln for ln in plane.lines if not ln.name.startswith(_DERIVED)]
        streams = [ln for ln in lines if ln.name.startswith("Stream")]
        for ln in streams or [ln for ln in lines if ln.name == "XLA Ops"] or lines:
            out += [(ev.start_ns, ev.start_ns + ev.duration_ns) for ev in ln.events]
    return out


def _host_windows(planes) -> dict[str, list[tuple[float, float]]]:
    """{label: [(start, end) ns of each timed call]} from our annotations on the host plane."""
    out: dict[str, list[tuple[float, float]]] = {}
    for plane in planes:
        if not plane.name.startswith("/host:"):
            continue
        for ln in plane.lines:
            for ev in ln.events:
                if ev.name.startswith(_TAG):
                    out.setdefault(ev.name[len(_TAG) :], []).append((ev.start_ns, ev.start_ns + ev.duration_ns))
    return out


def device_ms_per_window(planes) -> dict[str, list[float]]:
    """{label: [device busy ms inside each of its windows]}; {} when the trace has no device events."""
    events = _device_lines(planes)
    if not events:
        return {}
    out = {}
    for label, windows in _host_windows(planes).items():
        out[label] = [busy_ns([(max(s, a), min(e, b)) for s, e in events if s < b and e > a]) / 1e6 for a, b in windows]
    return out


@dataclasses.dataclass
class Timer:
    """Timed calls of one section. `call(label, fn)` runs and records one call; `results()` (after
    the trace ends) gives each label's times in ms from the device's clock where the trace has
    it, else the wall's, and which one."""

    trace_dir: str | None = None
    wall_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    device: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    trace_error: str | None = None

    def call(self, label: str, fn):
        """fn() once, blocked on, inside the label's annotation; returns its result."""
        import jax

        with jax.profiler.TraceAnnotation(_TAG + label):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn())
            self.wall_ms.setdefault(label, []).append((time.perf_counter() - t0) * 1e3)
        return out

    def times(self, label: str) -> tuple[list[float], str]:
        """(ms of each call, the clock: DEVICE_TRACE or WALL_CLOCK)."""
        dev = self.device.get(label)
        # every call must have device time: none inside a window means the trace's clocks did not line up
        if dev and len(dev) == len(self.wall_ms.get(label, ())) and min(dev) > 0:
            return dev, DEVICE_TRACE
        return self.wall_ms.get(label, []), WALL_CLOCK

    def read_trace(self) -> None:
        """Parse the finished trace's xplane into per-call device times (none on the CPU)."""
        import jax

        files = glob.glob(os.path.join(self.trace_dir or "", "**", "*.xplane.pb"), recursive=True)
        if not files:
            self.trace_error = self.trace_error or "no trace written"
            return
        try:
            self.device = device_ms_per_window(jax.profiler.ProfileData.from_file(files[0]).planes)
        except Exception as e:  # an unreadable trace: the wall clock stands
            self.trace_error = f"{type(e).__name__}: {e}"[:300]


@contextlib.contextmanager
def traced(keep: str | None = None, python: bool = False) -> Iterator[Timer]:
    """A Timer whose calls run under one profiler trace; on exit the trace is parsed and, with
    `keep` (a path ending .json.gz), its perfetto JSON copied there. A profiler that cannot
    start leaves the wall clock (Timer.trace_error says why)."""
    import tempfile

    import jax

    tmp = tempfile.mkdtemp(prefix="jaxserve-device-trace-")
    timer = Timer(trace_dir=tmp)
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 1 if python else 0  # Python tracing slows the host it would measure
    try:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True, profiler_options=opts)
        started = True
    except Exception as e:
        timer.trace_error, started = f"profiler did not start: {type(e).__name__}: {e}"[:300], False
    try:
        yield timer
    finally:
        if started:
            try:
                jax.profiler.stop_trace()
                timer.read_trace()
                found = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
                if keep and found:
                    shutil.copyfile(found[0], keep)
            except Exception as e:
                timer.trace_error = f"{type(e).__name__}: {e}"[:300]
        shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass
class Record:
    """A section's measurements, rewritten to `path` (JSON) after every one: a section killed at
    its budget still leaves what it finished. `extra` holds the section's other fields."""

    path: str
    deadline: float  # time.monotonic() after which no new measurement starts
    rows: list[dict] = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.flush()
        return row

    def flush(self) -> None:
        import json

        from jaxserve.tools.bench.result import _finite

        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_finite({"measurements": self.rows, **self.extra}), f, indent=1)
        os.replace(tmp, self.path)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def error_text(e: BaseException) -> str:
    """An exception as one line for the JSON's {"error": ...}."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else '(no message)'}"[:400]
