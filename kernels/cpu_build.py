"""Build the CPU kernels (``csrc/paged_cpu.cpp``) with the system C++ compiler, once per machine.

The source is plain C++ with OpenMP and no torch headers, so a build takes a few
seconds instead of the minute a torch extension needs; the launcher calls it
through ``ctypes``. The shared library is cached under ``build_dir`` with a name
that hashes the source, the flags, the compiler's version and this CPU's feature
flags (``-march=native`` code must not run on another CPU that shares a home
directory). A build writes a temporary file and renames it into place, so two
processes building at once both end with a complete library.

``$QKV_CPU_MARCH`` replaces ``native`` in ``-march`` (for example ``x86-64-v3``, AVX2 with FMA and F16C):
``.ci/run`` builds the AVX2 code paths that way on an AVX-512 machine, to check that no exactness test
depends on the wider vectors.

OpenMP: torch's CPU wheel ships ``libgomp.so.1``; the library links against that
same file when it exists, so qkv's threads and torch's share one OpenMP runtime
instead of two pools spinning against each other.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["SOURCE", "CXXFLAGS", "KernelBuildError", "build_library", "cxxflags", "find_compiler"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_cpu.cpp"
# No -ffast-math: NaN handling and the fixed reduction order (row invariance) rely on IEEE semantics.
CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")


def cxxflags() -> tuple[str, ...]:
    """:data:`CXXFLAGS`, with ``$QKV_CPU_MARCH`` (if set) as the ``-march`` target."""
    march = os.environ.get("QKV_CPU_MARCH")
    return tuple(f"-march={march}" if march and f == "-march=native" else f for f in CXXFLAGS)


class KernelBuildError(RuntimeError):
    """The C++ compiler is missing or failed; the message says which and how to fall back."""


def find_compiler() -> str | None:
    """``$CXX``, else ``c++`` or ``g++`` on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_gomp() -> list[str]:
    import torch

    lib = Path(torch.__file__).resolve().parent / "lib" / "libgomp.so.1"
    return [str(lib), f"-Wl,-rpath,{lib.parent}"] if lib.exists() else []


@functools.cache
def build_library(build_dir: Path) -> ctypes.CDLL:
    """Compile (if needed) and load the CPU kernel library; raises :class:`KernelBuildError`."""
    cxx = find_compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (set $CXX or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    extra = _torch_gomp()
    flags = cxxflags()
    sources = [p.read_text() for p in sorted(SOURCE.parent.iterdir()) if p.suffix in (".cpp", ".h")]
    key = hashlib.sha256("\0".join([*sources, *flags, *extra, version, _cpu_flags()]).encode())
    target = Path(build_dir) / f"qkv_paged_cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cxx, *flags, str(SOURCE), "-o", tmp, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))
