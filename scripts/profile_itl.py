"""Where a batch-1 decode step goes: the compiled engine under ``torch.profiler``, op times per decode step.

    .venv/bin/python scripts/profile_itl.py -o eval/results/bench/profile_itl_epyc_zen3_smollm2.json

SmolLM2-135M in bf16 with ``--compile-model``, one random 512-token prompt, 128 decode steps after the prefill
(the itl workload of ``scripts/bench_vllm.py``, shortened). First the inter-token latency without the profiler,
(t(129 tokens) - t(1 token)) / 128, the better of two; then one profiled run of 129 tokens, whose op table
(self and total CPU ms, calls) is divided by its 129 forwards. The prefill is one of them: its linears run on
oneDNN (``mkldnn::_linear_pointwise``) and its attention on SDPA, both under qkv's ops, so those lines say what
to subtract from the ops' totals for the decode steps alone. The profiler's own cost inflates short ops; the
latency line is the one without it. The JSON records the CPU's flags, the threads and the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qkv import LLM, SamplingParams
from qkv.eval.latency import random_prompts
from qkv.eval.machine import cpu_info, write_report
from qkv.registry import resolve_model

STEPS = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rows", type=int, default=25, help="op lines kept in the JSON, by self time")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    env = {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()}
    llm = LLM(
        str(resolve_model(args.model)),
        dtype="bfloat16",
        kv_cache_memory=1 << 30,
        enable_prefix_caching=False,
        compile_model=True,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompt = random_prompts(llm.llm_engine.model.config.vocab_size, 1, 512, 7, {0, 1, 2})

    def run(tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t0

    run(8)  # warm-up
    one, many = min(run(1) for _ in range(2)), min(run(STEPS + 1) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(STEPS + 1)
    forwards = STEPS + 1
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]
    report = {
        "env": env,
        "model": args.model,
        "kv_cache_dtype": args.kv_cache_dtype,
        "itl_ms": 1000 * (many - one) / STEPS,
        "forwards_profiled": forwards,
        "ops_per_forward": [
            {
                "op": e.key,
                "self_ms": e.self_cpu_time_total / 1000 / forwards,
                "total_ms": e.cpu_time_total / 1000 / forwards,
                "calls": e.count / forwards,
            }
            for e in ops
        ],
    }
    print(f"itl {report['itl_ms']:.2f} ms")
    for row in report["ops_per_forward"][:12]:
        print(
            f"  {row['op'][:50]:50s} self {row['self_ms']:7.3f} total {row['total_ms']:7.3f} calls {row['calls']:.1f}"
        )
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
