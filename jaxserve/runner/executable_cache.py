"""Compiled steps kept on disk, so that a restart neither traces, lowers nor compiles.

JAX's persistent compilation cache skips XLA compilation on a restart, but it still traces and
lowers every warm-up variant to compute its key: 2.5 s of the default model's 31 variants on a
2-core CPU, more than the compilation it saves on small models. This store keeps the executables
themselves (`jax.experimental.serialize_executable`), named by everything that shapes them: the
source of jaxserve and pallas_kernels, the jax/jaxlib/flax versions, the backend and its devices,
JAX's flags and XLA_FLAGS, the engine's and model's configuration, and the argument shapes,
dtypes and shardings of the variant. Any difference is a miss: the step is traced and compiled
as usual and its executable written. A file that fails to load is ignored and rewritten.

Only executables compiled in this process are written: one handed back by JAX's persistent
cache re-serializes incompletely on XLA:CPU (it loads, then fails when run), so in one process
the CLI leaves JAX's cache off and this store does its job. The compile, trace and cache-hit
counters below come from jax.monitoring; the engine re-exports compile_count as its tripwire.

Unpickling an executable can run code: only point the store at a directory you own.

`compile_ahead` lets a warm-up compile its executables side by side: XLA compiles one program on
one thread, and a cold start of the default model is mostly its 15 compiles in a row.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger("jaxserve.executable_cache")

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # restored from JAX's persistent cache
_events = {_BACKEND_COMPILE: 0, _TRACE: 0, _PERSISTENT_CACHE_HIT: 0}
_events_lock = threading.Lock()
# The same counts per thread: JAX reports a compile on the thread that compiles, so a step
# compiled beside others can still tell whether it was compiled or handed back by a cache.
_thread_events = threading.local()


def _count(name: str, *_args, **_kw) -> None:
    if name in _events:
        with _events_lock:
            _events[name] += 1
        counts = getattr(_thread_events, "counts", None)
        if counts is None:
            counts = _thread_events.counts = dict.fromkeys(_events, 0)
        counts[name] += 1


def _this_thread(name: str) -> int:
    return getattr(_thread_events, "counts", {}).get(name, 0)


_listening = False


def start_counting() -> None:
    """Register the listeners that count compiles, traces and persistent-cache hits (once,
    on first use rather than at import: importing a module changes no global state).
    Every Step starts counting when it is made, so nothing an engine compiles is missed."""
    global _listening
    with _events_lock:
        if _listening:
            return
        _listening = True
    jax.monitoring.register_event_duration_secs_listener(_count)  # compiles, traces
    jax.monitoring.register_event_listener(_count)  # persistent-cache hits


def compile_count() -> int:
    """XLA compilations in this process since counting started (executables restored from
    JAX's persistent cache included): the tripwire for compiles after warm-up."""
    start_counting()
    return _events[_BACKEND_COMPILE]


def trace_count() -> int:
    """Functions traced to jaxprs since counting started: a restart that loads its compiled
    steps from the executable store traces none of them."""
    start_counting()
    return _events[_TRACE]


SUBDIR = "jaxserve-executables"
_TRACED_PACKAGES = ("jaxserve", "pallas_kernels")


@functools.cache
def source_digest() -> str:
    """Every traced line lives in these two packages: a code change must be a miss."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in _TRACED_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment_digest() -> str:
    """What changes a trace or its executable besides our code and the arguments."""
    import flax
    import jaxlib

    flags = sorted((k, repr(v)) for k, v in getattr(jax.config, "values", {}).items() if "cache" not in k)
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    parts = (
        sys.version,
        jax.__version__,
        jaxlib.__version__,
        flax.__version__,
        np.__version__,
        jax.default_backend(),
        jax.devices()[0].client.platform_version,
        devices,
        jax.process_count(),
        os.environ.get("XLA_FLAGS", ""),
        os.environ.get("LIBTPU_INIT_ARGS", ""),
        flags,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def describe(tree: Any) -> str:
    """Structure, shapes, dtypes and shardings of an argument tree: what a compiled executable
    accepts. Uncommitted host arrays have no sharding and land on the default device."""
    leaves, treedef = jax.tree.flatten(tree)
    rows = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        weak = getattr(x, "weak_type", False)
        rows.append(f"{np.shape(x)}:{_dtype(x)}:{weak}:{sharding}")
    return "\n".join(rows)


def _dtype(x) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


class ExecutableStore:
    """One directory of serialized executables; `context` names the engine and model
    configuration they were compiled for."""

    def __init__(self, root: str | Path, context: str, devices: list | None = None):
        self.dir = Path(root).expanduser() / SUBDIR
        # The devices every executable runs on, in order (deserialization binds them; by
        # default it would take all of the backend's devices).
        self.devices = list(devices) if devices is not None else jax.devices()[:1]
        self.dir.mkdir(parents=True, exist_ok=True)
        ids = [d.id for d in self.devices]
        self._prefix = hashlib.sha256(
            f"{source_digest()}\n{environment_digest()}\n{context}\n{ids}".encode()
        ).hexdigest()
        self.loaded = 0
        self.saved = 0
        self._lock = threading.Lock()  # steps compiled side by side save from their threads

    def path(self, name: str, signature: str) -> Path:
        digest = hashlib.sha256(f"{self._prefix}\n{name}\n{signature}".encode()).hexdigest()
        return self.dir / f"{name}-{digest[:40]}.jxe"

    def load(self, name: str, signature: str) -> jax.stages.Compiled | None:
        path = self.path(name, signature)
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=self.devices
            )
        except Exception as e:  # a truncated or foreign file: compile instead, then overwrite it
            log.warning("ignoring unreadable compiled step %s (%s: %s)", path, type(e).__name__, e)
            return None
        with self._lock:
            self.loaded += 1
        return compiled

    def save(self, name: str, signature: str, compiled: jax.stages.Compiled) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # a cache must never stop serving; the executable is still used
            # e.g. XLA:CPU cannot serialize a sort it has already run, which happens when
            # jax's in-process cache hands back an executable another engine executed.
            log.info(
                "%s: this executable cannot be serialized, a restart compiles it (%s: %s)", name, type(e).__name__, e
            )
            return
        path = self.path(name, signature)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(blob)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as e:
            log.warning("cannot write compiled step %s (%s)", path, e)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self.saved += 1


class Deferred(Exception):
    """Raised by a Step inside `compile_ahead` in place of compiling in line: its program is
    lowered and compiling in the background. Make the same call again; it then waits for it."""


_ahead: ThreadPoolExecutor | None = None


@contextmanager
def compile_ahead(workers: int):
    """Within this block a Step that misses lowers its program (on this thread: tracing holds
    the GIL), hands the compile to one of `workers` threads and raises Deferred; the caller
    goes on to its next call and repeats the deferred ones later (ModelRunner.warmup). With
    workers <= 1, steps compile in line as elsewhere. For one thread only (the warm-up's)."""
    global _ahead
    if workers <= 1:
        yield
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool:
        _ahead = pool
        try:
            yield
        finally:
            _ahead = None


class Step:
    """A jitted step with one compiled executable per argument signature, compiled (or loaded
    from the store) on first use. The first `fixed` arguments (parameters, KV cache) never
    change shape, so the per-call lookup looks at the others only; the executable itself
    checks every argument and raises on a mismatch."""

    def __init__(self, name: str, jitted: Callable, store: ExecutableStore | None = None, fixed: int = 0):
        start_counting()
        self.name = name
        self.jitted = jitted
        self.store = store
        self.fixed = fixed
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        self._compiling: dict[Any, Future] = {}  # under compile_ahead

    def __call__(self, *args, **static):
        key = (
            tuple(sorted(static.items())),
            tuple((np.shape(x), _dtype(x)) for x in jax.tree.leaves(args[self.fixed :])),
        )
        exe = self._compiled.get(key)
        if exe is None:
            exe = self._compiled[key] = self._get(key, args, static)
        return exe(*args)

    def _get(self, key, args: tuple, static: dict) -> jax.stages.Compiled:
        signature = f"{sorted(static.items())}\n{describe(args)}"
        if key in self._compiling:  # compiled or loaded ahead; None: the stored file did not load
            exe = self._compiling.pop(key).result()
            return exe if exe is not None else self._compile(self.jitted.lower(*args, **static), signature)
        if _ahead is not None:
            if self.store is not None and self.store.path(self.name, signature).is_file():
                self._compiling[key] = _ahead.submit(self.store.load, self.name, signature)
            else:
                self._compiling[key] = _ahead.submit(self._compile, self.jitted.lower(*args, **static), signature)
            raise Deferred(self.name)
        if self.store is not None:
            exe = self.store.load(self.name, signature)
            if exe is not None:
                return exe
        return self._compile(self.jitted.lower(*args, **static), signature)

    def _compile(self, lowered: jax.stages.Lowered, signature: str) -> jax.stages.Compiled:
        compiles, hits = _this_thread(_BACKEND_COMPILE), _this_thread(_PERSISTENT_CACHE_HIT)
        exe = lowered.compile()
        if self.store is not None:
            if _this_thread(_BACKEND_COMPILE) > compiles and _this_thread(_PERSISTENT_CACHE_HIT) == hits:
                self.store.save(self.name, signature, exe)
            else:
                # Handed back by a cache, not compiled here. Two reasons not to keep it: XLA:CPU
                # re-serializes an executable restored from JAX's persistent cache without
                # all of its functions ("Function ... not found" when it runs), and cannot
                # serialize a sort that another engine in this process has already run.
                log.info("%s: from a compilation cache, not written to the store", self.name)
        return exe

    def __len__(self) -> int:
        return len(self._compiled)

    def executables(self) -> list[jax.stages.Compiled]:
        return list(self._compiled.values())
