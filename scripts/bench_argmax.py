"""Greedy picks on the CPU kernel (``CpuKernels.argmax_rows``) against torch's argmax, alone and in the engine.

    .venv/bin/python scripts/bench_argmax.py -o eval/results/bench/argmax_xeon_smollm2.json

``kernel``: the pick for 24 bf16 rows of SmolLM2's 49,152-token vocabulary, both ways, interleaved, 200 calls
each. ``engine``: one compiled engine per cache dtype whose runner alternates between the kernel and torch
(``ModelRunner.argmax`` set or None) on the same random prompts of 256 tokens, 64 greedy tokens a run, 5 runs
each; ms a token with the prefill, medians, and whether both arms produced the same tokens. The JSON records
the CPU's flags, the threads and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from decode_step import warm_engine  # scripts/ is on the path when this script runs

from qkv import SamplingParams
from qkv.eval.latency import random_prompts
from qkv.eval.machine import cpu_info, write_report
from qkv.registry import resolve_model

TOKENS, CONTEXT, RUNS = 64, 256, 5


def kernel_ms(argmax, calls: int = 200) -> dict[str, float]:
    logits = torch.randn(24, 49152, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = list(range(24))
    arms = {"kernel": lambda: argmax(logits, rows), "torch": lambda: logits[rows].float().argmax(-1).tolist()}
    assert arms["kernel"]() == arms["torch"]()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(5):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append(1000 * (time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8")
    ap.add_argument("--batches", default="12,24")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    report: dict = {
        "env": {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()},
        "context": CONTEXT,
        "tokens": TOKENS,
        "engine_ms_per_token": {},
        "same_tokens": {},
    }
    model, shared = str(resolve_model("smollm2-135m")), None
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    for dtype in args.kv_cache_dtypes.split(","):
        llm = warm_engine(model, dtype, shared)
        shared = llm.llm_engine.model
        runner = llm.llm_engine.runner
        arms = {"kernel": runner.argmax, "torch": None}
        if runner.argmax is None:
            raise SystemExit("the CPU kernels do not run this engine: nothing to compare")
        report.setdefault("kernel_ms_24x49152_bf16", kernel_ms(runner.argmax))
        vocab = shared.config.vocab_size
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = random_prompts(vocab, batch, CONTEXT, 1, {0, 1, 2})
            times: dict[str, list[float]] = {k: [] for k in arms}
            tokens: dict[str, list] = {}
            for _ in range(RUNS):
                for name, fn in arms.items():
                    runner.argmax = fn
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, sp)
                    times[name].append(1000 * (time.perf_counter() - t0) / TOKENS)
                    tokens[name] = [o.outputs[0].token_ids for o in outs]
            runner.argmax = arms["kernel"]
            med = {k: statistics.median(v) for k, v in times.items()}
            report["engine_ms_per_token"].setdefault(dtype, {})[batch] = {"median": med, "runs": times}
            report["same_tokens"].setdefault(dtype, {})[batch] = tokens["kernel"] == tokens["torch"]
            print(dtype, batch, {k: round(v, 2) for k, v in med.items()}, flush=True)
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
