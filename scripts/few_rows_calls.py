"""One-row decode linears on the few-row kernel: what the number of calls costs, beside what the bytes cost.

    .venv/bin/python scripts/few_rows_calls.py -o eval/results/bench/few_rows_calls_epyc_zen3_smollm2.json

SmolLM2-135M's 30 decoder layers with random bf16 weights (212 MB, far more than any cache), one row of x, the
kernel of ``qkv.kernels.cpu_gemm`` three ways over the same bytes, alternated ``--rounds`` times at each thread
count:

* ``separate``: q, k, v, o, gate, up and down, seven calls a layer, as the engine makes them today;
* ``stacked``: q/k/v and gate/up stacked, four calls a layer (the bound of stacking them for the kernel);
* ``whole``: every weight of one input width in one call, two calls in all (the bytes alone).

And one 1536 x 576 call with its weights hot in cache, repeated: the cost of a call whose work is small. The
JSON records medians and every round, the CPU's flags, the threads and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from qkv.eval.machine import cpu_info, write_report
from qkv.small_linear import few_rows_kernel

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
STACKED = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down
LAYERS = 30


def ms(fn, repeats: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - t0) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    kernel = few_rows_kernel()  # the engine's instance, built once per process
    if kernel is None:
        raise SystemExit("the few-row kernel did not build on this machine (the log says why)")
    gen = torch.Generator().manual_seed(0)

    def weights(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        return [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for n, k in shapes]

    ways = {
        "separate": weights(LAYER * LAYERS),
        "stacked": weights(STACKED * LAYERS),
        "whole": weights([(LAYERS * sum(n for n, k in LAYER if k == 576), 576), (LAYERS * 576, 1536)]),
    }
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for k in (576, 1536)}
    hot = weights([(1536, 576)])[0]
    report: dict = {
        "env": {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()},
        "weights_mb": {name: sum(w.numel() * 2 for w in ws) / 1e6 for name, ws in ways.items()},
        "calls": {name: len(ws) for name, ws in ways.items()},
        "step_ms": {},
        "hot_1536x576_us": {},
    }
    saved = torch.get_num_threads()
    for threads in sorted({1, saved}):
        torch.set_num_threads(threads)
        runs: dict[str, list[float]] = {name: [] for name in ways}
        for ws in ways.values():  # warm-up
            for w in ws:
                kernel.linear(xs[w.shape[1]], w, None)
        for _ in range(args.rounds):
            for name, ws in ways.items():
                runs[name].append(ms(lambda ws=ws: [kernel.linear(xs[w.shape[1]], w, None) for w in ws]))
        report["step_ms"][threads] = {n: {"median": statistics.median(r), "runs": r} for n, r in runs.items()}
        ms(lambda: kernel.linear(xs[576], hot, None), repeats=100)  # into cache
        report["hot_1536x576_us"][threads] = 1000 * ms(lambda: kernel.linear(xs[576], hot, None), repeats=3000)
        print(threads, "threads:", {n: round(statistics.median(r), 2) for n, r in runs.items()}, flush=True)
    torch.set_num_threads(saved)
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
