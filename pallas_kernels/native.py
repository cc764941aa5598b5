"""Native CPU kernels called from jitted JAX through XLA FFI.

``ragged_paged_attention`` is a drop-in for ``reference.ragged_paged_attention`` on the CPU,
inside or outside ``jax.jit`` (the engine's `native` attention backend): q [N, H, D] (float32 or
bfloat16) one flat array of query tokens in rows of any length (query_start_loc [R+1]), pages
[num_pages, page_size, KVH, D] (float32 or bfloat16; or int8 with bfloat16 scales [num_pages,
page_size, KVH], the kv_cache_dtype="int8" pool), block_tables [R, P], seq_lens [R], positions
[N]; key j of row r is visible to token n iff j < seq_lens[r] and j <= positions[n] (and, with a
sliding window W, j > positions[n] - W); a token that sees nothing gets zeros (the reference
would average every key there; no live query is like that).
Arithmetic is float32; the result has q's dtype. The C++ kernel is
``cpu/paged_attention.cc``: one work item per (row, KV head block), each K/V vector read once
for all the query heads sharing it, online softmax per page, the next page prefetched, work
shared with XLA's own CPU thread pool.

The shared library ``cpu/_jaxserve_cpu.so`` is built at install time only: ``pip install`` and
``pip install -e .`` (setup.py calls ``build_library``), or by hand after editing the C++
(``python -m pallas_kernels.native build``, which ``make native`` runs). Run time never compiles:
a library that is missing, or (where the sources sit beside it: a checkout) was built from
other sources than these (the sha256 the build embeds), is not loaded; ``available()`` is then
False, ``unavailable_reason()`` names the command that rebuilds it and one warning is logged to
``jaxserve.kernels``. The automatic backend choice then takes the XLA path (an install without a
compiler still serves); a backend asked for by name raises with that reason. Importing this
module never raises.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("jaxserve.kernels")

CPU_DIR = Path(__file__).resolve().parent / "cpu"
SOURCE = CPU_DIR / "paged_attention.cc"
SOURCES = (SOURCE, CPU_DIR / "matmul.cc", CPU_DIR / "argmax.cc")  # compiled together into one library
LIB_NAME = "_jaxserve_cpu.so"
RAGGED_TARGET = "jaxserve_ragged_paged_attention"  # one flat token array, rows of any length
RAGGED_TARGET_Q8 = "jaxserve_ragged_paged_attention_q8"  # int8 pages + bfloat16 scales (kv_cache_dtype="int8")
ABI_VERSION = (
    6  # must match jaxserve_cpu_abi_version() in the .cc (3: bf16 scales; 4: ragged; 5: avx512bf16; 6: window)
)
# avx512bf16: AVX-512 + AVX512-BF16 (the bf16 matmul by dot products); amx: that + the AMX bf16 tiles
ISAS = ("generic", "avx2", "avx512", "avx512bf16", "amx")
BF16_ISAS = ISAS[3:]  # bfloat16 arithmetic (dot products or tiles): the default precision there
BF16_WEIGHT_ISAS = ISAS[1:]  # where bfloat16 weights run natively (AVX2 / AVX-512: float32 arithmetic)
# The levels with vector code of their own in every kernel; amx adds only the tile matmul and runs
# the AVX-512 attention and argmax (their variant tests cover these three).
VECTOR_ISAS = ISAS[:3]

# -O3 and a portable baseline; the kernel carries its own AVX2 and AVX-512 variants, chosen at
# run time. JAXSERVE_CPU_MARCH_NATIVE=1 adds -march=native (not portable to other hosts).
CXX_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-Wno-psabi",
]


def ffi_include_dir() -> str:
    try:
        return jax.ffi.include_dir()
    except Exception:  # pragma: no cover - jax without the ffi module
        import jaxlib

        return str(Path(jaxlib.__file__).parent / "include")


def compiler() -> list[str] | None:
    """The C++ compiler command: $CXX (may carry arguments, e.g. "ccache g++"), else c++/g++/clang++."""
    cxx = shlex.split(os.environ.get("CXX", ""))
    if cxx and shutil.which(cxx[0]):
        return cxx
    for c in ("c++", "g++", "clang++"):
        if shutil.which(c):
            return [c]
    return None


def source_digest(sources=SOURCES) -> str:
    """sha256 over every source (name and bytes), in order, and the headers beside them (``*.h``
    in their folders, which they include): any edit to any of them changes it."""
    if isinstance(sources, (str, Path)):
        sources = (sources,)
    sources = [Path(s) for s in sources]
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    h = hashlib.sha256()
    for s in [*sources, *headers]:
        data = Path(s).read_bytes()
        h.update(f"{Path(s).name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def _marker(digest: str) -> bytes:  # embedded in the library (see JAXSERVE_SOURCE_SHA256 in the .cc)
    return f"jaxserve-source-sha256:{digest}".encode()


def build_library(out: Path, sources=SOURCES, include_dir: str | None = None) -> Path:
    """Compile ``sources`` (a path or a sequence of them) into the shared library ``out`` (written
    atomically), stamped with their sha256. Raises RuntimeError, with the compiler's output, on
    failure."""
    sources = (sources,) if isinstance(sources, (str, Path)) else tuple(sources)
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    flags = [*CXX_FLAGS, f'-DJAXSERVE_SOURCE_SHA256="{source_digest(sources)}"']
    if os.environ.get("JAXSERVE_CPU_MARCH_NATIVE") == "1":
        flags.append("-march=native")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=out.parent)
    os.close(fd)
    cmd = [*cxx, *flags, "-isystem", include_dir or ffi_include_dir(), *map(str, sources), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _built_from(lib: Path, digest: str) -> bool:
    try:
        return _marker(digest) in lib.read_bytes()
    except OSError:
        return False


REBUILD = "python -m pallas_kernels.native build (make native; or reinstall: pip install -e .)"


def _locate() -> Path:
    """The library to load. Raises RuntimeError, naming the command that rebuilds it, where it is
    missing or (a checkout, whose sources sit beside it) was built from other sources."""
    lib = CPU_DIR / LIB_NAME
    if not lib.exists():
        raise RuntimeError(f"{lib} is missing (its C++ build failed or was skipped at install); build it: {REBUILD}")
    if all(s.exists() for s in SOURCES) and not _built_from(lib, source_digest(SOURCES)):
        raise RuntimeError(f"{lib} was built from other sources than {CPU_DIR}/*.cc; rebuild it: {REBUILD}")
    return lib


_lock = threading.Lock()
_state: dict = {}


def _load():
    """The loaded ctypes library with its FFI target registered, or None (reason in _state)."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib = None
        try:
            path = _locate()
            lib = ctypes.CDLL(str(path))
            _state["path"] = path
            lib.jaxserve_cpu_abi_version.restype = ctypes.c_int
            if lib.jaxserve_cpu_abi_version() != ABI_VERSION:
                raise RuntimeError(
                    f"{path} has ABI {lib.jaxserve_cpu_abi_version()}, expected {ABI_VERSION}; rebuild it: {REBUILD}"
                )
            for name in ("jaxserve_cpu_isa", "jaxserve_cpu_best_isa", "jaxserve_cpu_set_isa"):
                getattr(lib, name).restype = ctypes.c_int
            lib.jaxserve_cpu_set_isa.argtypes = [ctypes.c_int]
            jax.ffi.register_ffi_target(
                RAGGED_TARGET, jax.ffi.pycapsule(lib.JaxserveRaggedPagedAttention), platform="cpu"
            )
            jax.ffi.register_ffi_target(
                RAGGED_TARGET_Q8, jax.ffi.pycapsule(lib.JaxserveRaggedPagedAttentionQ8), platform="cpu"
            )
            log.debug("native CPU kernels: loaded %s (%s)", path, ISAS[lib.jaxserve_cpu_isa()])
        except Exception as e:  # never raise from here: report once and fall back
            lib = None
            _state["error"] = f"{type(e).__name__}: {e}"
            log.warning("native CPU kernels unavailable, the XLA path will be used: %s", _state["error"])
        _state["lib"] = lib
        return lib


class MoreKernels:
    """Further FFI targets in the same library (the matmul, the argmax), each set with its own
    ABI number: registered with XLA on first use. A library built without them (or from an
    older source) leaves them unavailable, with the reason logged once; `fallback` says what
    runs instead."""

    def __init__(self, what: str, abi_symbol: str, abi_version: int, targets: dict[str, str], fallback: str):
        self.what, self.abi_symbol, self.abi_version = what, abi_symbol, abi_version
        self.targets, self.fallback = targets, fallback  # FFI target name -> exported handler symbol
        self._lock = threading.Lock()
        self._state: dict = {}

    def available(self) -> bool:
        """True when these kernels are built, loaded and registered with XLA (CPU only)."""
        if "ok" in self._state:
            return self._state["ok"]
        with self._lock:
            if "ok" in self._state:
                return self._state["ok"]
            ok = False
            lib = _load()
            if lib is None:
                self._state["error"] = unavailable_reason()
            else:
                try:
                    abi = getattr(lib, self.abi_symbol)
                    abi.restype = ctypes.c_int
                    if abi() != self.abi_version:
                        raise RuntimeError(f"{self.what} ABI {abi()}, expected {self.abi_version}")
                    for target, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                    ok = True
                except Exception as e:
                    self._state["error"] = f"{type(e).__name__}: {e}"
                    log.warning("native %s unavailable, %s: %s", self.what, self.fallback, self._state["error"])
            self._state["ok"] = ok
            return ok

    def unavailable_reason(self) -> str | None:
        return None if self.available() else self._state.get("error")


def available() -> bool:
    """True when the native library is built, loaded and registered with XLA (CPU only)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")


def cpu_isa() -> str:
    """The instruction set the kernels use now: generic, avx2, avx512, avx512bf16 (AVX-512 and
    AVX512-BF16's dot products) or amx (those and the AMX bfloat16 tiles); the last two differ
    from avx512 only in the bfloat16 matmul."""
    lib = _load()
    return "unavailable" if lib is None else ISAS[lib.jaxserve_cpu_isa()]


def best_cpu_isa() -> str:
    """The best instruction set this host has, whatever JAXSERVE_CPU_ISA or set_cpu_isa chose
    (what set_cpu_isa can raise the kernels back to); "unavailable" without the kernels."""
    lib = _load()
    return "unavailable" if lib is None else ISAS[lib.jaxserve_cpu_best_isa()]


def set_cpu_isa(name: str) -> str:
    """Use at most this instruction set (for testing every variant on one host); returns the
    one now in use. The default is the best the host has (JAXSERVE_CPU_ISA lowers it:
    JAXSERVE_CPU_ISA=avx512 turns the bfloat16 matmul off, avx512bf16 the AMX tiles)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {_state.get('error')}")
    return ISAS[lib.jaxserve_cpu_set_isa(ISAS.index(name))]


_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    query_start_loc,
    seq_lens,
    block_tables,
    positions,
    scale,
    k_scales=None,
    v_scales=None,
    *,
    kv_heads_per_item: int = 0,
    sliding_window: int | None = None,
):
    """Same arguments and result as ``reference.ragged_paged_attention``; runs the native CPU kernel.

    q [N, H, D] is one flat array of query tokens; row r owns tokens
    [query_start_loc[r], query_start_loc[r + 1]) (query_start_loc [R+1] int32, nondecreasing
    from 0) and reads its keys through block_tables[r]; token n of row r sees key j iff
    j < seq_lens[r] and j <= positions[n]. A token that sees nothing, and every padding token
    (n >= query_start_loc[R]), gets zeros. Decode rows (1 token), prefill chunks and speculative
    verification (k + 1 tokens) go in one call. With k_scales/v_scales (bfloat16 [num_pages,
    page_size, KVH], as the pool stores them; other float types are rounded to bfloat16) the
    pages are int8 (kv_cache_dtype="int8", reference.quantize_kv) and are dequantized while read;
    float8 pages are not supported here (ValueError). ``kv_heads_per_item`` (0 = automatic) sets
    how many KV heads one work item covers; ``sliding_window`` W (None or 0: none) also hides key
    j when j <= positions[n] - W. Index arrays whose shapes do not fit q and each other raise
    ValueError naming the field; RuntimeError where ``available()`` is False.
    """
    _check_ragged_shapes(q, query_start_loc, seq_lens, block_tables, positions)
    return _call(
        (RAGGED_TARGET, RAGGED_TARGET_Q8),
        q,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        scale,
        kv_heads_per_item,
        sliding_window,
        query_start_loc,
        seq_lens,
        block_tables,
        positions,
    )


def _check_ragged_shapes(q, query_start_loc, seq_lens, block_tables, positions) -> None:
    """q [N, H, D], query_start_loc [R+1], seq_lens [R], block_tables [R, P], positions [N]."""
    shape = lambda a: tuple(jnp.shape(a))  # noqa: E731
    if len(shape(q)) != 3:
        raise ValueError(f"q: expected [N, H, D], got shape {shape(q)}")
    n = shape(q)[0]
    if len(shape(seq_lens)) != 1:
        raise ValueError(f"seq_lens: expected [R], got shape {shape(seq_lens)}")
    r = shape(seq_lens)[0]
    want = {
        "query_start_loc": ((r + 1,), "[R+1]"),
        "positions": ((n,), "[N]"),
    }
    for name, a in (("query_start_loc", query_start_loc), ("positions", positions)):
        if shape(a) != want[name][0]:
            raise ValueError(f"{name}: expected {want[name][1]} = {want[name][0]} (R={r}, N={n}), got {shape(a)}")
    if len(shape(block_tables)) != 2 or shape(block_tables)[0] != r:
        raise ValueError(f"block_tables: expected [R, P] with R={r}, got shape {shape(block_tables)}")


def _call(targets, q, k_pages, v_pages, k_scales, v_scales, scale, kv_heads_per_item, window, *index_arrays):
    """One FFI call of the float (targets[0]) or int8 (targets[1]) handler: q cast to a float type
    the kernel reads, pages and scales checked, the int32 index arrays after the pages; window
    the sliding window (None or 0: full attention)."""
    if window is not None and int(window) < 0:
        raise ValueError(f"sliding_window must be positive (None or 0: full attention), got {window}")
    if _load() is None:
        raise RuntimeError(f"native CPU kernels unavailable: {_state.get('error')}")
    q = jnp.asarray(q)
    out_dtype = q.dtype
    if q.dtype not in _FLOATS:
        q = q.astype(jnp.float32)
    if k_scales is not None:
        if k_pages.dtype != jnp.int8 or v_pages.dtype != jnp.int8:
            raise ValueError(
                f"the native kernel reads int8 quantized pages only (kv_cache_dtype='int8'), got {k_pages.dtype}"
            )
        scales = (jnp.asarray(k_scales, jnp.bfloat16), jnp.asarray(v_scales, jnp.bfloat16))  # the kernel reads BF16
    else:
        if k_pages.dtype != jnp.uint16:  # uint16: bfloat16 bits (reference.BF16_BITS), read as bfloat16
            page_dtype = k_pages.dtype if k_pages.dtype in _FLOATS else jnp.dtype(jnp.float32)
            k_pages = k_pages.astype(page_dtype)
            v_pages = v_pages.astype(page_dtype)
        scales = ()
    try:
        s = np.float32(float(scale))  # an F32 attribute (a Python float would arrive as F64)
    except (TypeError, jax.errors.ConcretizationTypeError):  # a traced scale: fold it into q
        q, s = q.astype(jnp.float32) * scale, np.float32(1.0)
    target = targets[1] if scales else targets[0]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    out = call(
        q,
        k_pages,
        v_pages,
        *scales,
        *(jnp.asarray(a, jnp.int32) for a in index_arrays),
        scale=s,
        kv_heads_per_item=np.int64(kv_heads_per_item),
        window=np.int64(window or 0),
    )
    return out.astype(out_dtype)


def main(argv: list[str] | None = None) -> int:
    """``python -m pallas_kernels.native build [OUT.so]``: compile the library (default: into the
    package, where the loader looks); ``check``: say whether the library here is loadable and
    current (exit status 1 where it is not)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.native", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile the native CPU kernels")
    build.add_argument("out", nargs="?", type=Path, default=CPU_DIR / LIB_NAME)
    sub.add_parser("check", help="is the library built from these sources and loadable?")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build_library(args.out))
        return 0
    if available():
        print(f"{_state['path']}: current, {cpu_isa()}")
        return 0
    print(unavailable_reason(), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
