"""GPU check for the Triton kernels: their tests compiled, split-KV on a GPU, decode attention vs the roofline.

One command for the first session that is lent a CUDA device (about 5 minutes on one
H200, 8 at most)::

    python -m qkv.kernels.gpu_check            # writes kernels/results/gpu_check.{json,md}

1. **Kernel tests, compiled**: every ``tests/kernels/test_*.py`` except the CPU-only compile
   check and this script's own dry run, with ``TRITON_INTERPRET`` unset, one process per
   file in parallel (bit-exact cache bytes, attention vs the reference, sm_80 paths).
2. **Split-KV on the GPU**: a batch-1 decode at 32,768 tokens with 8 kv heads, split
   (as launched) against the same call forced to one segment.
3. **Decode attention** for bf16, fp8 e4m3 and int8 caches at 1k, 8k and 32k context and
   batch 1, 16 and 64 (Llama-3-8B heads: 32 query, 8 kv, head_dim 128, random block
   tables): the launches' kernel time (captured launches replayed), the whole launcher
   call (the step's tile plan made once, as the runner shares it across layers), the
   fraction of the HBM roofline (:mod:`.roofline`: bytes / 4.8 TB/s / time), programs
   launched, and torch SDPA on a contiguous bf16 cache at the same points.

Each part's results are written as soon as it finishes, and a part that fails records
its error without losing the others. ``--dry-run`` runs everything on the CPU under the
Triton interpreter with tiny sizes (CI runs it); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "kernels" / "results"
CPU_ONLY_TESTS = ("test_compile.py", "test_gpu_check.py")


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def run_kernel_tests(dry_run: bool, timeout_s: float) -> list[dict]:
    """Each kernel test file in its own pytest process, all at once (compiling is CPU-bound)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    files = sorted(p.name for p in (ROOT / "tests" / "kernels").glob("test_*.py") if p.name not in CPU_ONLY_TESTS)
    extra = ["-k", "segment_heuristic"] if dry_run else []  # the dry run checks the plumbing only
    if dry_run:
        env["TRITON_INTERPRET"], files = "1", ["test_split_kv.py"]

    def one(name: str) -> dict:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/kernels/{name}", *extra]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            # TimeoutExpired carries bytes even with text=True
            rc, text = "timeout", _text(e.stdout) + _text(e.stderr)
            text = text.decode() if isinstance(text, bytes) else text
        return {
            "file": name,
            "returncode": rc,
            "seconds": round(time.perf_counter() - t0, 1),
            "tail": text.strip().splitlines()[-12:],
        }

    with ThreadPoolExecutor(len(files)) as pool:
        return list(pool.map(one, files))


def _time_ms(fn, device: str, iters: int) -> float:
    """Median milliseconds per call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


CACHES = ("bfloat16", "fp8_e4m3", "int8", "int4_per_token_head")  # the decode timings and split checks


def _decode_inputs(name: str, context: int, batch: int, shape, device: str, seed: int = 0) -> dict:
    """A paged cache of random content (no NaN bytes) with shuffled blocks, and one query per sequence."""
    from .paged import PagedLayer, StepMetadata
    from .quant import resolve_cache_dtype

    dt = resolve_cache_dtype(name)
    hq, hkv, d, bs = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    blocks = batch * -(-context // bs)
    g = torch.Generator(device="cpu").manual_seed(seed)
    cache = torch.empty(dt.cache_shape(blocks + 1, bs, hkv, d), device=device, dtype=dt.storage)
    if dt.packed:  # every byte is two valid int4 codes (or one int8 code)
        cache.random_(0, 256)
    elif dt.kind == "int":
        cache.view(torch.int8).random_(-127, 128)
    else:
        cache.view(dt.storage).copy_(torch.randn(cache.shape, device=device).to(dt.storage))
    tables = (torch.randperm(blocks, generator=g) + 1).view(batch, -1)
    scales = torch.full((hkv,), 0.02, device=device) if dt.quantized and not dt.dynamic else None
    scale_cache = torch.full((blocks + 1, 2, bs, hkv), 0.02, device=device) if dt.dynamic else None
    return dict(
        layer=PagedLayer(cache, dt, scales, scales, scale_cache),
        query=torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16),
        meta=StepMetadata.build([-1] * batch, tables, [context] * batch, device=device),
        sm_scale=d**-0.5,
    )


def check_split(context: int, device: str, shape) -> dict:
    """Split decode (as launched) vs the same call on one segment, batch 1."""
    from .launch import capture
    from .triton_attention import triton_attend

    out = {}
    for name in CACHES:
        args = _decode_inputs(name, context, 1, shape, device, seed=1)
        with capture(execute=True) as launches:
            split = triton_attend(**args).float()
        whole = triton_attend(**args, num_sms=1).float()
        err = ((split - whole).abs().max() / whole.abs().max()).item()
        # bf16 outputs: one rounding step of bf16 is 2**-8 of the value, so 1e-2 allows a few
        out[name] = {
            "programs": launches[0].programs,
            "grid": launches[0].grid,
            "max_rel_err": err,
            "ok": err < 1e-2 and bool(torch.isfinite(split).all()),
        }
    return out


def bench_decode(contexts, batches, device: str, iters: int, shape, gpu, emit) -> None:
    """Times every (cache, context, batch) point and calls ``emit(row)`` after each one."""
    from .launch import capture
    from .roofline import decode_bytes
    from .triton_attention import triton_attend

    for context in contexts:
        for batch in batches:
            for name in CACHES:
                row = {"cache": name, "context": context, "batch": batch}
                try:
                    args = _decode_inputs(name, context, batch, shape, device)
                    with capture(execute=True) as launches:
                        out = triton_attend(**args)
                    row["finite"] = bool(torch.isfinite(out).all())
                    segments = launches[0].grid[2]
                    row.update(segments=segments, programs=launches[0].programs)

                    def kernels(launches=launches):  # the captured launches, replayed: kernel time only
                        for la in launches:
                            la.kernel[la.grid](*la.args, **la.kwargs)

                    row["kernel_ms"] = _time_ms(kernels, device, iters)
                    row["call_ms"] = _time_ms(lambda args=args: triton_attend(**args), device, iters)
                    nbytes = decode_bytes(name, context, batch, shape, segments)["total"]
                    row["roofline_ms"] = nbytes / gpu.hbm_bytes_per_s * 1e3
                    row["fraction_of_hbm"] = row["roofline_ms"] / row["kernel_ms"]
                    del args, out
                except Exception as e:  # noqa: BLE001 - one failing point must not lose the others
                    row["error"] = f"{type(e).__name__}: {e}"
                emit(row)
            try:
                q = torch.randn(batch, shape.num_q_heads, 1, shape.head_dim, device=device, dtype=torch.bfloat16)
                kv = torch.randn(
                    2, batch, shape.num_kv_heads, context, shape.head_dim, device=device, dtype=torch.bfloat16
                )
                sdpa = functools.partial(
                    torch.nn.functional.scaled_dot_product_attention, q, kv[0], kv[1], enable_gqa=True
                )
                row = {
                    "cache": "sdpa_contiguous_bf16",
                    "context": context,
                    "batch": batch,
                    "kernel_ms": _time_ms(sdpa, device, iters),
                }
                row["fraction_of_hbm"] = (kv.numel() * 2 / gpu.hbm_bytes_per_s * 1e3) / row["kernel_ms"]
                del sdpa, q, kv
            except Exception as e:  # noqa: BLE001
                row = {
                    "cache": "sdpa_contiguous_bf16",
                    "context": context,
                    "batch": batch,
                    "error": f"{type(e).__name__}: {e}",
                }
            emit(row)
            if device == "cuda":
                torch.cuda.empty_cache()


def summary_markdown(report: dict) -> str:
    lines = [
        f"# gpu_check {'(dry run, interpreter: numbers mean nothing)' if report['dry_run'] else ''}",
        "",
        f"{report['device']}, torch {report['torch']}, triton {report['triton']}, {report['date']}",
        "",
        "## Kernel tests, compiled",
        "",
    ]
    for t in report.get("kernel_tests", []):
        lines.append(f"- `{t['file']}`: return code {t['returncode']} in {t['seconds']} s — {(t['tail'] or [''])[-1]}")
    lines += [
        "",
        "## Split-KV at 32k (batch 1, 8 kv heads) vs one segment",
        "",
        "```",
        json.dumps(report.get("split_check"), indent=1),
        "```",
        "",
        "## Decode attention",
        "",
        "| cache | context | batch | segments | programs | kernel ms | call ms | roofline ms | fraction of HBM |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report.get("decode", []):
        if "error" in r:
            lines.append(f"| {r['cache']} | {r['context']} | {r['batch']} | error: {r['error'][:80]} | | | | | |")
            continue

        def f(k: str, fmt: str = ".4f", r: dict = r) -> str:
            return format(r[k], fmt) if k in r else ""

        lines.append(
            f"| {r['cache']} | {r['context']} | {r['batch']} | {r.get('segments', '')} | "
            f"{r.get('programs', '')} | {f('kernel_ms')} | {f('call_ms')} | {f('roofline_ms')} | "
            f"{f('fraction_of_hbm', '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    p.add_argument("--skip-tests", action="store_true")
    args = p.parse_args(argv)
    from .roofline import H200, LLAMA3_8B, Shape

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        device, contexts, batches, iters, split_ctx = "cpu", [64, 600], [1, 2], 2, 600
        shape, test_timeout = Shape("tiny", 4, 2, 32, 1), 300
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry-run to check the script on a CPU", file=sys.stderr)
            return 2
        device, contexts, batches, iters, split_ctx = "cuda", [1024, 8192, 32768], [1, 16, 64], 20, 32768
        shape, test_timeout = LLAMA3_8B, 270
    import triton

    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": args.dry_run,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "shape": vars(shape),
        "roofline_gpu": vars(H200),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check_dry_run" if args.dry_run else "gpu_check"

    def save() -> None:
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / f"{stem}.md").write_text(summary_markdown(report))

    def part(key: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            report[key] = fn()
        except Exception:  # noqa: BLE001 - record it, keep going
            report[key + "_error"] = traceback.format_exc()[-2000:]
        report.setdefault("seconds", {})[key] = round(time.perf_counter() - t0, 1)
        save()
        print(f"gpu_check: {key} done in {report['seconds'][key]} s", flush=True)

    if not args.skip_tests:
        part("kernel_tests", lambda: run_kernel_tests(args.dry_run, test_timeout))
    part("split_check", lambda: check_split(split_ctx, device, shape))
    report["decode"] = []

    def emit(row: dict) -> None:
        report["decode"].append(row)
        save()
        print(json.dumps(row), flush=True)

    part("decode_done", lambda: bench_decode(contexts, batches, device, iters, shape, H200, emit) or True)
    print(f"wrote {out / stem}.json and .md")
    failed = [t for t in report.get("kernel_tests", []) if t["returncode"] != 0]
    split_ok = all(v["ok"] for v in (report.get("split_check") or {"x": {"ok": False}}).values())
    errors = [k for k in report if k.endswith("_error")] + [r for r in report["decode"] if "error" in r]
    return 1 if failed or not split_ok or errors else 0


if __name__ == "__main__":
    sys.exit(main())
