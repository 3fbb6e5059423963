"""GPU check for the Triton kernels: run their tests compiled, then benchmark paged decode attention.

Usage on a CUDA machine (finishes in a few minutes on one H100/H200)::

    python -m qkv.kernels.gpu_check --out kernels/results

1. Runs ``tests/test_kernel_cache_write.py``, ``tests/test_kernel_attention.py`` and
   ``tests/test_kernel_rotation_channel.py`` with ``TRITON_INTERPRET`` unset, so the kernels are compiled for the GPU
   (bit-exact cache bytes vs torch, attention within 1e-3).
2. Times paged *decode* attention (one query token per sequence) at 1k, 8k and
   32k context for a BF16 and an FP8 (e4m3, per-head scales) cache, and FP8 with
   Hadamard rotation and per-channel scales (qkv's extensions), Llama-3-8B
   shaped heads (32 query heads, 8 kv heads, head_dim 128), and torch SDPA on
   contiguous BF16 K/V as the yardstick. Reports time and effective GB/s (bytes
   of K/V, scales included, read once per call).

``--dry-run`` runs step 2 with tiny contexts on the CPU under the Triton
interpreter, to check the script itself where no GPU is available.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run_kernel_tests() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_kernel_cache_write.py", "tests/test_kernel_attention.py",
           "tests/test_kernel_rotation_channel.py"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd[2:]), "returncode": proc.returncode,
            "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def _time(fn, device: str, iters: int) -> float:
    """Median milliseconds per call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2]


def bench_decode(contexts: list[int], batch: int, device: str, iters: int) -> list[dict]:
    from .quant import resolve_cache_dtype
    from .reference import write_kv_cache
    from .triton_attention import triton_paged_attention

    hq, hkv, d, bs = 32, 8, 128, 16
    rows = []
    for ctx in contexts:
        blocks_per_seq = ctx // bs
        num_blocks = batch * blocks_per_seq + 1
        g = torch.Generator(device="cpu").manual_seed(ctx)
        perm = torch.randperm(num_blocks - 1, generator=g) + 1
        tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(device)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, hkv, ctx, d, device=device, dtype=torch.bfloat16)
        v = torch.randn(batch, hkv, ctx, d, device=device, dtype=torch.bfloat16)
        slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=device)).reshape(batch, ctx)
        row = {"context": ctx, "batch": batch}
        for label, name, rotate, channel in (("bfloat16", "bfloat16", False, False),
                                             ("fp8_e4m3", "fp8_e4m3", False, False),
                                             ("fp8_e4m3+hadamard+channel", "fp8_e4m3", True, True)):
            dt = resolve_cache_dtype(name)
            cache = torch.zeros(num_blocks, 2, bs, hkv, d, dtype=dt.storage, device=device)
            ks = vs = torch.full((hkv, d) if channel else (hkv,), 0.01, device=device) if dt.quantized else None
            for s in range(batch):  # fill the cache with the reference writer (setup, not timed)
                write_kv_cache(k[s].transpose(0, 1), v[s].transpose(0, 1), cache, slots[s], dt, ks, vs,
                               rotate=rotate)

            def call(cache=cache, dt=dt, ks=ks, vs=vs, rotate=rotate):
                return triton_paged_attention(q, cache, tables, seq_lens, qsl, dt, ks, vs, None, d ** -0.5,
                                              rotate=rotate)

            ms = _time(call, device, iters)
            nbytes = 2 * batch * ctx * hkv * d * dt.itemsize
            row[label] = {"ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6, 1)}

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

        ms = _time(sdpa, device, iters)
        row["sdpa_contiguous_bf16"] = {"ms": round(ms, 4), "GB/s": round(2 * batch * ctx * hkv * d * 2 / ms / 1e6, 1)}
        row["fp8_speedup_vs_bf16_paged"] = round(row["bfloat16"]["ms"] / row["fp8_e4m3"]["ms"], 3)
        row["bf16_paged_vs_sdpa"] = round(row["sdpa_contiguous_bf16"]["ms"] / row["bfloat16"]["ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "kernels" / "results"))
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    p.add_argument("--skip-tests", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        device, contexts, batch, iters = "cpu", [64, 128], 2, 2
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry-run to check the script on a CPU", file=sys.stderr)
            return 2
        device, contexts, batch, iters = "cuda", [1024, 8192, 32768], 16, 50
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "dry_run": args.dry_run,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if not args.skip_tests and not args.dry_run:
        report["kernel_tests"] = run_kernel_tests()
        print(json.dumps(report["kernel_tests"], indent=1), flush=True)
    report["decode_attention"] = bench_decode(contexts, batch, device, iters)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_check_dry_run.json" if args.dry_run else "gpu_check.json"
    (out / name).write_text(json.dumps(report, indent=2))
    print(f"wrote {out / name}")
    failed = report.get("kernel_tests", {}).get("returncode", 0) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
