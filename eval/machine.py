"""What machine a benchmark ran on: the CPU's name, the instruction-set flags that change its arithmetic
and speed, and its core count. Every benchmark JSON records it, because machines of one kind differ
(an AMD EPYC with AVX2 only, an Intel Xeon with AVX-512 and AMX) and their times do not compare."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

__all__ = ["FLAGS", "cpu_info", "source_commit", "write_report"]

FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",  # with F, what the few-row kernel's AVX-512 tiles need
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


def cpu_info() -> dict:
    """``{"name", "flags", "cores"}``, with ``flags`` the members of :data:`FLAGS` this CPU reports."""
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"name": name, "flags": sorted(f for f in FLAGS if f in flags), "cores": os.cpu_count()}


def source_commit(root: Path | None = None) -> str | None:
    """The checkout's commit (``git rev-parse --short HEAD``), with ``+dirty`` where tracked files differ from it,
    so that a figure measured on uncommitted code says so; None outside a git checkout. ``root`` defaults to the
    checkout this module is in."""
    root = (root or Path(__file__).resolve().parent.parent).resolve()
    try:
        git = ["git", "-C", str(root)]
        top, head = subprocess.run(
            [*git, "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.split()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        )
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None
    if Path(top).resolve() != root:  # an installed copy inside some other repository (a venv in a project)
        return None
    return head + ("+dirty" if changed.stdout.strip() else "")


def write_report(report: dict, path: Path) -> None:
    """Stamp the load average after the runs into ``report["env"]`` (a figure measured while other jobs ran is
    not quoted), and the commit measured unless the report has one (:func:`source_commit`), then write the JSON to
    ``path``."""
    report["env"]["load_average_after"] = os.getloadavg()
    report["env"].setdefault("qkv_commit", source_commit())
    path.write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", path)
