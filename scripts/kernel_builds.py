"""The CPU kernel library as another commit had it, for benchmarks that interleave two builds in one process.

Imported by ``bench_cpu_attention.py`` and ``bench_few_rows.py``, with the alternation they time the builds in;
not a script of its own.
"""

from __future__ import annotations

import ctypes
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from qkv.kernels.cpu_build import _torch_gomp, cxxflags, find_compiler

ROOT = Path(__file__).resolve().parent.parent


def build_at(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The kernel sources of commit ``rev`` (kernels/csrc, its headers too), compiled with this checkout's flags
    (the C interface is the same)."""
    tree = subprocess.run(
        ["git", "archive", "--format=tar", rev, "kernels/csrc"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out_dir)], input=tree, check=True)
    src = out_dir / "kernels" / "csrc" / "paged_cpu.cpp"
    lib = out_dir / "baseline.so"
    subprocess.run([find_compiler(), *cxxflags(), str(src), "-o", str(lib), *_torch_gomp()], check=True)
    return ctypes.CDLL(str(lib))


def alternated(fns: dict[str, Callable[[], object]], rounds: int, calls: int = 1) -> dict[str, list[float]]:
    """Milliseconds per call of each of ``fns``, ``calls`` calls a round, over ``rounds`` rounds; which one goes
    first alternates from round to round, so that a drift of the machine's speed falls on both."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            runs[name].append(1000 * (time.perf_counter() - t0) / calls)
    return runs
