"""A decode step's linears at a few rows, three ways: where the few-row kernel stops paying (``MIN_ROWS``).

    .venv/bin/python scripts/bench_few_rows.py [--rows 1,2,3,4,6,8] -o OUT.json

Every linear of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down, and the 49,152-row LM head: 270 MB of
bf16 weights, far more than any cache) once per pass, with random weights, as a decode step streams them:

* ``torch_bf16``: ``F.linear`` on the bf16 weights (transformers' arithmetic);
* ``few_rows``: the C++ kernel of ``qkv.kernels.cpu_gemm`` on the bf16 weights;
* ``fp32``: oneDNN's inner product on reordered fp32 copies (``qkv.cpu_linear.Fp32Linear``'s batched path).

The best of five passes each, interleaved; the JSON records the CPU's flags, the threads and the load average.

``--baseline REV`` times the kernel alone instead, this checkout's build against commit REV's, alternated over
``--rounds`` rounds at each row count (medians and every round in the JSON), and counts the outputs in which the
two builds differ (0 for a change that keeps the bits); then each build's read rate on one large one-row call,
beside torch's fp32 ``sum``:

    .venv/bin/python scripts/bench_few_rows.py --baseline REV --rows 1,2,4,8,16,48 -o OUT.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_builds import alternated, build_at

from qkv.eval.machine import cpu_info, write_report
from qkv.kernels.cpu_gemm import SmallGemm
from qkv.registry import default_cache_dir

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def against(
    kernel: SmallGemm, baseline: SmallGemm, weights: list[torch.Tensor], rows: list[int], rounds: int, gen
) -> dict:
    """Both builds over every weight once per pass, alternated (which goes first alternates too)."""
    report: dict = {
        "env": {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()},
        "weights_mb": sum(w.numel() * 2 for w in weights) / 1e6,
        "pass_ms": {},
    }
    builds = {"this": kernel, "baseline": baseline}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        differ = sum(
            int((kernel.linear(xs[w.shape[1]], w, None) != baseline.linear(xs[w.shape[1]], w, None)).sum())
            for w in weights
        )
        passes = {
            name: lambda k=k, xs=xs: [k.linear(xs[w.shape[1]], w, None) for w in weights] for name, k in builds.items()
        }
        runs = alternated(passes, rounds)
        med = {name: statistics.median(v) for name, v in runs.items()}
        report["pass_ms"][m] = {
            "median": med,
            "runs": runs,
            "speedup": med["baseline"] / med["this"],
            "outputs_differing": differ,
        }
        print(
            f"{m} rows: this {med['this']:.2f} ms, baseline {med['baseline']:.2f} ms, "
            f"{med['baseline'] / med['this']:.3f}x, {differ} outputs differ",
            flush=True,
        )
    report["read_gb_s"] = read_rates(builds, gen)
    return report


def read_rates(builds: dict[str, SmallGemm], gen: torch.Generator) -> dict:
    """GB/s of one one-row call on a 453 MB weight, per build and thread count, beside what torch's fp32 ``sum``
    reads from a 256 MB tensor: how near the kernel comes to the machine's read bandwidth without the fixed
    cost of many calls. The better of three each."""
    w = (torch.randn(8 * 49152, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(1, 576, generator=gen).bfloat16()
    f = torch.ones(64 << 20)
    saved, rates = torch.get_num_threads(), {}
    fns = {name: (lambda k=k: k.linear(x, w, None), w.numel() * 2) for name, k in builds.items()}
    fns["torch_fp32_sum"] = (f.sum, f.numel() * 4)
    for threads in sorted({1, saved}):
        torch.set_num_threads(threads)
        for name, (fn, nbytes) in fns.items():
            fn()
            best = min(alternated({name: fn}, 3)[name])
            rates.setdefault(name, {})[threads] = nbytes / best / 1e6
    torch.set_num_threads(saved)
    print("read GB/s:", {n: {t: round(v, 1) for t, v in r.items()} for n, r in rates.items()}, flush=True)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--baseline", help="time this checkout's kernel against commit BASELINE's, alternated")
    ap.add_argument("--rounds", type=int, default=8, help="alternated rounds per row count with --baseline")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    kernel = SmallGemm.build(default_cache_dir() / "kernels")
    if kernel is None:
        raise SystemExit("the few-row kernel did not build on this machine")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for n, k in SHAPES]
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            baseline = SmallGemm(build_at(args.baseline, Path(tmp)))
            report = against(kernel, baseline, weights, [int(r) for r in args.rows.split(",")], args.rounds, gen)
        report["baseline"] = args.baseline
        write_report(report, args.output)
        return 0
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.float(), 16) for w in weights]
    report: dict = {
        "env": {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()},
        "weights_mb": sum(w.numel() * 2 for w in weights) / 1e6,
        "pass_ms": {},
    }
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        ways = {
            "torch_bf16": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
            "few_rows": lambda xs=xs: [kernel(xs[w.shape[1]], w) for w in weights],
            "fp32": lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]].float(), p, None, "none", [], "").bfloat16()
                for w, p in zip(weights, packed)
            ],
        }
        row = {name: best_ms(fn) for name, fn in ways.items()}
        report["pass_ms"][m] = row
        print(f"{m} rows: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row.items()), flush=True)
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
