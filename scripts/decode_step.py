"""One decode step's time at a fixed batch and context, per cache dtype: how a step grows with its rows.

    .venv/bin/python scripts/decode_step.py [--batches 12,24] [--context 256] [--kv-cache-dtypes auto,fp8] -o OUT.json

(``--batches 12,24,34 -o eval/results/bench/decode_step_xeon_smollm2.json`` made the committed JSON.)

The budget row of ``scripts/bench_vllm.py`` runs about twice the sequences in an 8-bit cache as in bf16, so what
an 8-bit cache buys there is at most 2 x step(B) / step(2B) at the batches B it runs. Each figure is
(t(1 + N tokens) - t(1 token)) / N for a batch of random prompts of ``--context`` tokens (compiled, greedy,
``ignore_eos``), the best of two runs each, so the prefill cancels out; the JSON records the CPU's flags, the
threads and the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from qkv import LLM, SamplingParams
from qkv.eval.latency import random_prompts
from qkv.eval.machine import cpu_info, write_report
from qkv.registry import resolve_model

STEPS = 32


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    return time.perf_counter() - t0


def warm_engine(model: str, kv_cache_dtype: str, shared=None) -> LLM:
    """A compiled bf16 engine with a 1 GiB cache, no prefix caching and up to 64 sequences (on ``shared``, a model
    an earlier engine loaded, if given), compiled and warmed up by a short generate."""
    llm = LLM(
        model,
        preloaded_model=shared,
        dtype="bfloat16",
        kv_cache_memory=1 << 30,
        enable_prefix_caching=False,
        max_num_seqs=64,
        compile_model=True,
        kv_cache_dtype=kv_cache_dtype,
    )
    vocab = llm.llm_engine.model.config.vocab_size
    llm.generate(random_prompts(vocab, 2, 64, 999, {0, 1, 2}), SamplingParams(temperature=0, max_tokens=4))
    return llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="12,24")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    report: dict = {
        "env": {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()},
        "context": args.context,
        "steps": STEPS,
        "step_ms": {},
    }
    model, shared = str(resolve_model(args.model)), None
    for dtype in args.kv_cache_dtypes.split(","):
        llm = warm_engine(model, dtype, shared)
        shared = llm.llm_engine.model
        vocab = shared.config.vocab_size
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = random_prompts(vocab, batch, args.context, 1, {0, 1, 2})
            long = min(timed(llm, prompts, 1 + STEPS) for _ in range(2))
            ms = 1000 * (long - min(timed(llm, prompts, 1) for _ in range(2))) / STEPS
            report["step_ms"].setdefault(dtype, {})[batch] = ms
            print(f"{dtype} batch {batch}, {args.context} tokens of context: {ms:.2f} ms a decode step", flush=True)
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
