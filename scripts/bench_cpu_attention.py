"""The fused CPU decode-attention kernel at SmolLM2's shapes, this checkout's against a baseline commit's.

This checkout's runs as the engine runs it by default (``dense_prefill``: decode rows in bf16 products where the
CPU has them, AMX tiles or VDPBF16PS, ``decode_products`` in the JSON); the baseline as its commit's kernel ran,
or with ``--baseline-products`` in the same products (to time a change inside them; the JSON then says how many
outputs differ, 0 for a change that keeps the rows bit for bit).

One decode step of 16 sequences at 1,050 tokens of context (9 query and 3 kv heads of 64, bf16 queries, blocks
of 16, per-head static scales where the dtype has them) as 30 calls, the model's layer count: ``warm`` calls one
layer's cache 30 times, ``cold`` walks 60 distinct copies of it, so the pool comes from memory as in the
engine. The two builds are interleaved, repeat by repeat; the JSON records every run, the CPU flags, the
threads and the load average.

    python scripts/bench_cpu_attention.py --baseline 1a6b09a -o eval/results/bench/cpu_attention_smollm2.json

``--prefill`` times the dense prefill kernel instead (``csrc/dense_prefill.h``): one 2,048-token chunk of bf16
queries against its own 2,048 keys (causal), SmolLM2's heads, on each bf16 product this CPU has (AMX tiles,
VDPBF16PS), the two builds interleaved the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the kernel tests' scenario builder: a shuffled pool, real writes

from kernel_builds import alternated, build_at  # noqa: E402
from support.paged import paged_scenario  # noqa: E402

from qkv.eval.machine import cpu_info, write_report  # noqa: E402
from qkv.kernels.cpu_attention import CpuKernels  # noqa: E402
from qkv.registry import default_cache_dir  # noqa: E402

DTYPES = ("bfloat16", "fp8_e4m3", "int8", "int8_per_token_head", "int4_per_token_head", "k8v4_per_token_head")
SEQS, CONTEXT, LAYERS, COLD_COPIES = 16, 1050, 30, 60


PREFILL_TOKENS = 2048


def prefill(args: argparse.Namespace, report: dict, tmp: Path) -> None:
    """The dense prefill kernel of both builds on each bf16 product this CPU has, interleaved."""

    def head_build(kind: str) -> CpuKernels:
        return CpuKernels.build(default_cache_dir() / "kernels", dense_prefill=True, dense_tiles=kind)

    kinds = [k for k in ("amx", "avx512_bf16") if head_build(k).dense_tiles == k]
    if not kinds:
        print("this CPU has neither AMX nor AVX512-BF16: the dense prefill kernel does not run here")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(PREFILL_TOKENS, 9, 64, generator=gen).to(torch.bfloat16)
    kv = torch.randn(2, 3, PREFILL_TOKENS, 64, generator=gen).to(torch.bfloat16)
    report["shape"] = {"tokens": PREFILL_TOKENS, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "causal": True}
    baseline = build_at(args.baseline, tmp) if kinds else None
    for kind in kinds:
        builds = {
            "baseline": CpuKernels(baseline, dense_prefill=True, dense_tiles=kind),
            "head": head_build(kind),
        }
        outs = {b: k._tiled(q, kv, PREFILL_TOKENS, None, 0.125) for b, k in builds.items()}
        diff = (outs["head"].float() - outs["baseline"].float()).abs()
        calls = {b: lambda k=k: k._tiled(q, kv, PREFILL_TOKENS, None, 0.125) for b, k in builds.items()}
        runs = alternated(calls, args.repeats, calls=10)
        med = {b: statistics.median(v) for b, v in runs.items()}
        report["results"][kind] = {
            "runs_ms": runs,
            "median_ms": med,
            "speedup": med["baseline"] / med["head"],
            "outputs_differing": float((diff > 0).float().mean()),
            "max_abs_diff": float(diff.max()),
        }
        print(kind, {b: round(v, 2) for b, v in med.items()}, flush=True)


def per_step_ms(kernels: CpuKernels, layers: list, sc, calls: int) -> float:
    """Milliseconds for ``LAYERS`` calls, walking ``layers`` round robin."""
    t0 = time.perf_counter()
    for i in range(calls):
        kernels.attend(layers[i % len(layers)], sc.query, sc.meta, sc.sm_scale)
    return 1000 * (time.perf_counter() - t0) * LAYERS / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="the commit whose kernel to compare with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill", action="store_true", help="time the dense prefill kernel instead of decode")
    ap.add_argument(
        "--baseline-products",
        action="store_true",
        help="run the baseline's decode rows in bf16 products too (for a commit that has them), not its row loop",
    )
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    report: dict = {
        "shape": {"seqs": SEQS, "context": CONTEXT, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "layers": LAYERS},
        "env": {
            "cpu": cpu_info(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before": os.getloadavg(),
            "head": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip(),
            "baseline": args.baseline,
        },
        "results": {},
    }
    if args.prefill:
        with tempfile.TemporaryDirectory() as tmp:
            prefill(args, report, Path(tmp))
        write_report(report, args.output)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        builds = {
            "baseline": CpuKernels(build_at(args.baseline, Path(tmp)), dense_prefill=args.baseline_products),
            "head": CpuKernels.build(default_cache_dir() / "kernels", dense_prefill=True),
        }
        report["env"]["decode_products"] = builds["head"].dense_tiles
        for name in DTYPES:
            sc = paged_scenario(name, [CONTEXT] * SEQS, [1] * SEQS, hq=9, hkv=3, d=64, q_dtype=torch.bfloat16, seed=1)
            copies = [
                replace(
                    sc.layer,
                    kv=sc.layer.kv.clone(),
                    scale_cache=None if sc.layer.scale_cache is None else sc.layer.scale_cache.clone(),
                )
                for _ in range(COLD_COPIES)
            ]
            outs = {b: k.attend(sc.layer, sc.query, sc.meta, sc.sm_scale).float() for b, k in builds.items()}
            torch.testing.assert_close(outs["head"], outs["baseline"], rtol=0, atol=3e-2)  # agree to bf16 rounding
            diff = (outs["head"] - outs["baseline"]).abs()
            runs: dict = {f"{b} {m}": [] for b in builds for m in ("warm", "cold")}
            for r in range(args.repeats):
                order = list(builds) if r % 2 == 0 else list(builds)[::-1]
                for b in order:
                    runs[f"{b} warm"].append(per_step_ms(builds[b], [sc.layer], sc, LAYERS))
                    runs[f"{b} cold"].append(per_step_ms(builds[b], copies, sc, 2 * COLD_COPIES))
            med = {k: statistics.median(v) for k, v in runs.items()}
            report["results"][name] = {
                "runs_ms": runs,
                "median_ms": med,
                "speedup_warm": med["baseline warm"] / med["head warm"],
                "speedup_cold": med["baseline cold"] / med["head cold"],
                "outputs_differing": float((diff > 0).float().mean()),
                "max_abs_diff": float(diff.max()),
            }
            print(name, {k: round(v, 1) for k, v in med.items()}, flush=True)
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
