"""Compile every kernel specialization qkv launches for real GPUs, on a machine without one.

Why: Triton's interpreter executes Python and forgives code the compiler rejects (a
bf16 cache write that did not compile anywhere, fp8 that did not compile on sm_80).
Triton compiles for CUDA targets without a GPU, and its wheel bundles ptxas.

For each architecture (sm_80, sm_89, sm_90, sm_100) this

1. drives the real launchers in capture mode (:mod:`.compile_specs`), so the launchers
   choose every constexpr, tile and option;
2. turns each captured launch into the exact specialization a real launch compiles —
   signature, constexprs, divisibility attributes and options come from Triton's own
   binder for that target — and drops duplicates;
3. compiles them in a process pool (a fresh Triton cache, so ptxas always runs) and
   reads per specialization: registers, stack and static shared memory from the cubin
   (``cuobjdump -res-usage``), spill stores/loads from ptxas's ``-v`` log, and the
   dynamic shared memory Triton allocates.

``python -m qkv.kernels.compile_check`` writes ``kernels/results/compile.json`` and exits
non-zero on any compile error or any register spill. ``tests/kernels/test_compile.py``
runs it in CI and checks that the committed file lists the same specializations with the
same resources. Step 2 uses Triton's binder (``create_function_from_signature`` and
``JITFunction._pack_args``, Triton 3.9), not a hand-made signature, so that attributes
such as 16-byte divisibility match a real launch; a Triton upgrade may need it adjusted.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ARCHS = (80, 89, 90, 100)
RESULTS = Path(__file__).resolve().parent / "results" / "compile.json"

__all__ = ["ARCHS", "specializations", "compile_one", "run", "to_json", "main"]


def _options_kwargs(launch_kwargs: dict) -> dict:
    from triton import knobs

    kw = dict(launch_kwargs)
    kw.setdefault("debug", knobs.runtime.debug)
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kw


def _lib_names(options: dict) -> list:
    """``extern_libs`` with file names only, so an id is the same in every checkout and venv."""
    return [[name, Path(path).name] for name, path in options.get("extern_libs") or ()]


def specializations(launches: list, arch: int) -> list[dict]:
    """Unique compile jobs for ``arch``, built the way ``JITFunction.run`` builds them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binders: dict[int, Any] = {}
    seen: dict[str, dict] = {}
    for launch in launches:
        kernel = launch.kernel
        if id(kernel) not in binders:
            binders[id(kernel)] = create_function_from_signature(kernel.signature, kernel.params, backend)
        kwargs = _options_kwargs(launch.kwargs)
        bound, specialization, options = binders[id(kernel)](*launch.args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        names = [p.name for p in kernel.params]
        spec = {
            "kernel": launch.name,
            "module": kernel.fn.__module__,
            "arch": arch,
            "signature": {k: v for k, v in signature.items() if v != "constexpr"},
            "_signature": signature,
            "constexprs": {names[path[0]]: value for path, value in constexprs.items()},
            "attrs": {names[path[0]]: value for path, value in attrs.items()},
            "num_warps": options.num_warps,
            "num_stages": options.num_stages,
            "_constexprs": [[list(p), v] for p, v in constexprs.items()],
            "_attrs": [[list(p), v] for p, v in attrs.items()],
            "_options": options.__dict__,
        }
        key = json.dumps(
            {
                "kernel": spec["kernel"],
                "signature": signature,
                "constexprs": spec["constexprs"],
                "attrs": spec["attrs"],
                # the libdevice path names this install's site-packages; the id must not
                "_options": {**spec["_options"], "extern_libs": _lib_names(spec["_options"])},
            },
            sort_keys=True,
            default=str,
        )
        spec["id"] = hashlib.sha1(key.encode()).hexdigest()[:12]
        spec["divisible_by_16"] = sorted(n for n, a in spec.pop("attrs").items() if ["tt.divisibility", 16] in a)
        seen.setdefault(key, spec)
    return list(seen.values())


def _bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _res_usage(cubin: bytes) -> dict:
    """REG, STACK, SHARED, LOCAL of the cubin's kernel, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {}
    for field in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{field}:(\d+)", out)
        usage[field.lower()] = int(m.group(1)) if m else None
    return usage


def _ptxas_spills(log: str) -> tuple[int, int]:
    stores = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    loads = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", log))
    return stores, loads


def _ptxas_log(ptx: str, arch: int, fp_fusion: bool) -> str:
    """``ptxas -v`` on the PTX, with the flags Triton's ``make_cubin`` uses."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [
            get_ptxas(arch).path,
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            *([] if fp_fusion else ["--fmad=false"]),
            f"--gpu-name={sm_arch_from_capability(arch)}",
            f.name,
            "-o",
            os.devnull,
        ]
        return subprocess.run(cmd, capture_output=True, text=True).stderr


def _worker_init(cache_dir: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # ptxas -v output, printed by Triton when it compiles


def compile_one(spec: dict) -> dict:
    """Compile one specialization for its architecture; resources, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    constexprs = {tuple(p): v for p, v in spec["_constexprs"]}
    attrs = {tuple(p): v for p, v in spec["_attrs"]}
    out = {k: v for k, v in spec.items() if not k.startswith("_")}
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(kernel, spec["_signature"], constexprs, attrs),
                target=GPUTarget("cuda", spec["arch"], 32),
                options=spec["_options"],
            )
    except Exception as e:  # noqa: BLE001 - every failure is a result to report
        out.update(
            ok=False, error=f"{type(e).__name__}: {str(e).strip()[-600:]}", seconds=round(time.perf_counter() - t0, 2)
        )
        return out
    log_text = log.getvalue()
    if "Used " not in log_text:  # Triton took the cubin from a cache and ran no ptxas: ask it again
        log_text = _ptxas_log(compiled.asm["ptx"], spec["arch"], spec["_options"].get("enable_fp_fusion", True))
    stores, loads = _ptxas_spills(log_text)
    out.update(
        ok=True,
        seconds=round(time.perf_counter() - t0, 2),
        **_res_usage(compiled.asm["cubin"]),
        spill_stores=stores,
        spill_loads=loads,
        dynamic_shared=compiled.metadata.shared,
    )
    return out


def _cost(spec: dict) -> int:
    """Rough compile cost, so the pool starts the slow jobs first."""
    c = spec["constexprs"]
    return (
        c.get("HEAD_DIM", c.get("BLOCK_D", 64))
        * (4 if c.get("ROTATE") else 1)
        * (2 if spec["kernel"] == "_paged_attention_kernel" else 1)
    )


def run(archs: tuple[int, ...] = ARCHS, jobs: int = 2) -> dict:
    """Capture, deduplicate and compile for every architecture; the report :func:`main` writes."""
    from .compile_specs import drive

    t0 = time.perf_counter()
    specs = []
    for arch in archs:
        specs += specializations(drive(arch), arch)
    capture_s = time.perf_counter() - t0
    specs.sort(key=_cost, reverse=True)
    with (
        tempfile.TemporaryDirectory(prefix="qkv-triton-cache-") as cache_dir,
        ProcessPoolExecutor(jobs, initializer=_worker_init, initargs=(cache_dir,)) as pool,
    ):
        results = list(pool.map(compile_one, specs))
    results.sort(key=lambda r: (r["arch"], r["kernel"], r["id"]))
    per_arch = {}
    for arch in archs:
        rs = [r for r in results if r["arch"] == arch]
        ok = [r for r in rs if r["ok"]]
        per_arch[f"sm_{arch}"] = {
            "specializations": len(rs),
            "failures": len(rs) - len(ok),
            "spills": sum(1 for r in ok if r["spill_stores"] or r["spill_loads"]),
            "max_registers": max((r["reg"] for r in ok), default=None),
            "max_stack": max((r["stack"] for r in ok), default=None),
            "max_dynamic_shared": max((r["dynamic_shared"] for r in ok), default=None),
        }
    import triton

    return {
        "triton": triton.__version__,
        "archs": [f"sm_{a}" for a in archs],
        "summary": {
            "specializations": len(results),
            "failures": sum(1 for r in results if not r["ok"]),
            "spills": sum(v["spills"] for v in per_arch.values()),
            "wall_seconds": round(time.perf_counter() - t0, 1),
            "capture_seconds": round(capture_s, 1),
            "jobs": jobs,
        },
        "per_arch": per_arch,
        "results": results,
    }


def to_json(report: dict) -> str:
    """The report with one line per specialization (a diff then shows which ones changed)."""
    head = json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1)
    rows = ",\n".join(json.dumps(r, separators=(",", ":"), default=str) for r in report["results"])
    return head[:-2] + ',\n "results": [\n' + rows + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90 (default: all four)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (it must compile, not interpret)", file=sys.stderr)
        return 2
    report = run(tuple(args.arch or ARCHS), args.jobs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_json(report))
    s = report["summary"]
    for arch, v in report["per_arch"].items():
        print(
            f"{arch}: {v['specializations']} specializations, {v['failures']} failures, {v['spills']} spills, "
            f"max {v['max_registers']} registers"
        )
    for r in report["results"]:
        if not r["ok"] or r["spill_stores"] or r["spill_loads"]:
            print(
                f"  {'FAIL' if not r['ok'] else 'SPILL'} sm_{r['arch']} {r['kernel']} {r['id']} "
                f"{r.get('error') or r['constexprs']}"
            )
    print(f"{s['specializations']} compiles in {s['wall_seconds']} s with {s['jobs']} jobs -> {out}")
    return 1 if s["failures"] or s["spills"] else 0


if __name__ == "__main__":
    sys.exit(main())
