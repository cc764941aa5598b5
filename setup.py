"""Build step for the native CPU kernels; all package metadata lives in pyproject.toml.

``pip install .`` and ``pip install -e .`` compile ``pallas_kernels/cpu/paged_attention.cc``,
``pallas_kernels/cpu/matmul.cc`` and ``pallas_kernels/cpu/argmax.cc`` (``native.SOURCES``) with the system C++ compiler (``$CXX``, else c++/g++/clang++) into
``pallas_kernels/cpu/_jaxserve_cpu.so``, with the flags in ``pallas_kernels/native.py``
(``-O3 -std=c++17 -fPIC -shared``, portable: the kernel picks its AVX2/AVX-512 code at run time;
``JAXSERVE_CPU_MARCH_NATIVE=1`` adds ``-march=native``). The XLA FFI headers come from jaxlib,
a build requirement. If the build fails the install still succeeds, with a warning:
``pallas_kernels.native.available()`` is then False and the XLA path is used. This and
``python -m pallas_kernels.native build`` (``make native``, after editing the C++) are the only
builds: run time refuses a missing library, or one built from other sources, naming that command.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB = "pallas_kernels.cpu._jaxserve_cpu"
SOURCES = ["pallas_kernels/cpu/paged_attention.cc", "pallas_kernels/cpu/matmul.cc", "pallas_kernels/cpu/argmax.cc"]


def _native_module():
    """pallas_kernels/native.py, loaded by path (the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location("_jaxserve_native_build", ROOT / "pallas_kernels" / "native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildNative(build_ext):
    """Builds the FFI library as a plain shared object (not a Python extension module)."""

    def get_ext_filename(self, fullname):
        # Called with the full dotted name and with its last part alone (get_ext_fullpath).
        if fullname in (LIB, LIB.rpartition(".")[2]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name != LIB:
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            _native_module().build_library(out, sources=[ROOT / s for s in SOURCES])
        except Exception as e:  # never fail the install: the XLA path still works
            msg = str(e).strip().splitlines()
            print(
                f"WARNING: jaxserve: the native CPU kernels were not built; the XLA path will be used. "
                f"{msg[0] if msg else type(e).__name__}",
                file=sys.stderr,
            )
            for line in msg[1:20]:
                print(f"  {line}", file=sys.stderr)
            return
        print(f"jaxserve: built {out}", file=sys.stderr)


setup(
    ext_modules=[Extension(LIB, sources=SOURCES, depends=["pallas_kernels/cpu/work_pool.h"], optional=True)],
    cmdclass={"build_ext": BuildNative},
)
