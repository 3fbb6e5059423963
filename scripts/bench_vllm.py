"""qkv and vLLM's CPU build side by side, interleaved, on one model directory, token ids and KV byte budget.

    .venv/bin/python scripts/bench_vllm.py [--repeats 3] [--workloads budget,decode16,prefill,itl] [--eager]
        [-o eval/results/bench/vllm_compare_smollm2.json]

vLLM runs from its own venv (``bash scripts/vllm_venv.sh``; ``--vllm-python`` names another), one
``scripts/vllm_worker.py`` process per cache dtype and KV budget, kept alive and idle while qkv runs. Every
engine, qkv's and vLLM's, gets the same random token ids, greedy decoding with ``ignore_eos``, prefix caching
off, at most 64 running sequences, a max_model_len of 2,560 and the same KV bytes; warm-up is not timed. Both
engines compile their model (qkv with ``--compile-model``; ``--eager`` runs qkv without). vLLM
keeps its own scheduling defaults otherwise (its CPU block size is 128 tokens, qkv's 16). Workloads:

* ``budget``: 48 requests x (128 prompt + 256 output) tokens at a 96 MiB KV budget: output tokens/s. The
  decode-heavy row, where what an 8-bit cache buys shows: twice the sequences fit.
* ``decode16``: 16 x (1,024 + 128) at 1 GiB: seconds.
* ``prefill``: 8 x 2,048 prompt tokens, 1 output token: seconds (the batch's time to first token).
* ``itl``: batch 1, a 512-token prompt, 256 output tokens: inter-token latency, (t(256) - t(1)) / 255 from
  two runs, so the prefill cancels out.

Each repeat runs every engine once, in rotating order, so a drift of the machine hits all alike, and each alone:
the vLLM workers not being timed are frozen (SIGSTOP), since an idle vLLM's wake-ups slow the engine beside it. The JSON
records medians, every run (for qkv's budget runs also how full the batch was: steps, preemptions, running
sequences by quarter of the run), ratios (qkv over vLLM, higher is better for qkv; qkv's dtypes over its bf16),
the CPU's flags, the thread count and the load average before and after. vLLM's fp8 cache needs AVX-512 or
AMX: on a CPU without both, the JSON says so and only vLLM bf16 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from qkv import LLM, SamplingParams
from qkv.eval.latency import random_prompts, rotate_order
from qkv.eval.machine import cpu_info, source_commit
from qkv.eval.vllm_engine import VllmEngine, VllmError, default_vllm_python, vllm_fp8_supported
from qkv.registry import resolve_model

ROOT = Path(__file__).resolve().parent.parent
INT8_SCALES = ROOT / "eval/results/smollm2-search/scales/int8-tensor-none.safetensors"
WORKLOADS = {  # name: (requests, prompt tokens, output tokens, KV budget in MiB)
    "budget": (48, 128, 256, 96),
    "decode16": (16, 1024, 128, 1024),
    "prefill": (8, 2048, 1, 1024),
    "itl": (1, 512, 256, 1024),
}
QKV_CONFIGS = {  # label: EngineConfig keywords
    "qkv bf16": {"kv_cache_dtype": "auto"},
    "qkv fp8": {"kv_cache_dtype": "fp8"},
    "qkv int8": {"kv_cache_dtype": "int8", "kv_scales": str(INT8_SCALES)},
    "qkv int8_per_token_head": {"kv_cache_dtype": "int8_per_token_head"},
}
VLLM_CONFIGS = {"vllm bf16": "auto", "vllm fp8": "fp8"}
FIELDS = ("requests", "prompt_len", "output_len", "kv_mib")
# Both engines size requests against this (vLLM refuses a KV budget smaller than one request of the model's
# own 8,192 positions); the longest workload needs 2,049.
MAX_MODEL_LEN = 2560


class VllmRunner:
    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        return self.engine.generate(prompts, max_tokens)


class QkvRunner:
    """qkv's engine; besides the time, each run's scheduling: steps, preemptions and the running sequences after
    each step (``schedule``), which say how full the batch was, and for how long it drained at the end."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.schedule: dict = {}

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine = self.llm.llm_engine
        stats, step = engine.stats, engine.step
        before = (stats.num_steps, stats.num_preemptions)
        running: list[int] = []

        def counted_step():  # one attribute read a step: no cost that shows in the timing
            out = step()
            running.append(stats.num_running)
            return out

        engine.step = counted_step  # type: ignore[method-assign]
        try:
            t0 = time.perf_counter()
            outs = self.llm.generate(prompts, sp)
            seconds = time.perf_counter() - t0
        finally:
            del engine.step  # the instance attribute; the class's method again
        n = len(running)
        self.schedule = {
            "steps": stats.num_steps - before[0],
            "preemptions": stats.num_preemptions - before[1],
            "mean_running": statistics.fmean(running) if running else 0.0,
            # the mean running sequences in each quarter of the steps: the last is the drain, once nothing waits
            "running_by_quarter": [statistics.fmean(running[i * n // 4 : (i + 1) * n // 4] or [0]) for i in range(4)],
        }
        return seconds, [list(o.outputs[0].token_ids) for o in outs]


def measure(runner, workload: str, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    n, _, out_len, _ = WORKLOADS[workload]
    if workload == "itl":
        t1, _ = runner.run(prompts, 1)
        t_all, ids = runner.run(prompts, out_len)
        return {"itl_ms": 1000 * (t_all - t1) / (out_len - 1), "ttft_s": t1, "seconds": t_all}, ids
    seconds, ids = runner.run(prompts, out_len)
    row = {"seconds": seconds}
    if workload == "budget":
        row["output_tokens_per_s"] = n * out_len / seconds
        if isinstance(runner, QkvRunner):
            row["schedule"] = runner.schedule
    return row, ids


METRIC = {
    "budget": ("output_tokens_per_s", True),
    "decode16": ("seconds", False),
    "prefill": ("seconds", False),
    "itl": ("itl_ms", False),
}  # (metric, higher is better)


def speed(workload: str, a: float, b: float) -> float:
    """How many times faster ``a`` is than ``b`` on ``workload``'s metric."""
    return a / b if METRIC[workload][1] else b / a


def run_group(args, model: str, workloads: list[str], kv_mib: int, report: dict) -> None:
    kv_bytes = kv_mib << 20
    runners: dict[str, object] = {}
    shared = None
    for label, kw in QKV_CONFIGS.items():
        llm = LLM(
            model,
            preloaded_model=shared,
            dtype="bfloat16",
            kv_cache_memory=kv_bytes,
            enable_prefix_caching=False,
            max_num_seqs=64,
            max_model_len=MAX_MODEL_LEN,
            compile_model=not args.eager,
            **kw,
        )
        shared = llm.llm_engine.model
        runners[label] = QkvRunner(llm)
    vocab = shared.config.vocab_size
    workers: list[VllmEngine] = []
    if args.vllm_python:
        for label, dt in VLLM_CONFIGS.items():
            if dt == "fp8" and not report["vllm_fp8_supported"]:
                continue
            spec = {
                "model": model,
                "kv_cache_dtype": dt,
                "kv_bytes": kv_bytes,
                "max_num_seqs": 64,
                "max_model_len": MAX_MODEL_LEN,
            }
            try:
                w = VllmEngine(spec, args.vllm_python)
            except VllmError as e:
                report["vllm_starts"].append({"label": label, "kv_mib": kv_mib, "error": str(e)})
                print(f"{label}: {e}", file=sys.stderr)
                continue
            report["vllm_starts"].append({"label": label, "kv_mib": kv_mib, **w.info})
            workers.append(w)
            runners[label] = VllmRunner(w)
    prompts = {
        w: random_prompts(vocab, WORKLOADS[w][0], WORKLOADS[w][1], args.seed + i, {0, 1, 2})
        for i, w in enumerate(workloads)
    }

    def alone(label: str) -> None:
        """Only ``label``'s engine awake: the vLLM workers not being timed are frozen (VllmEngine.pause)."""
        for other, runner in runners.items():
            if isinstance(runner, VllmRunner):
                (runner.engine.resume if other == label else runner.engine.pause)()

    try:
        for label, runner in runners.items():  # warm-up: first calls allocate and compile
            alone(label)
            runner.run(random_prompts(vocab, 2, 64, args.seed + 999, {0, 1, 2}), 4)
        labels = list(runners)
        for r in range(args.repeats):
            for label in rotate_order(labels, r):
                alone(label)
                for w in workloads:
                    row, ids = measure(runners[label], w, prompts[w])
                    res = report["results"].setdefault(w, {}).setdefault(label, {"runs": []})
                    res["runs"].append(row)
                    if r == 0:
                        res["token_ids_head"] = [x[:32] for x in ids[:4]]
                    metric = METRIC[w][0]
                    print(f"repeat {r + 1} {w} {label}: {metric} {row[metric]:.4g}", flush=True)
    finally:
        for w in workers:
            w.close()


def summarize(report: dict) -> None:
    for w, rows in report["results"].items():
        metric, _ = METRIC[w]
        for row in rows.values():
            row[metric] = statistics.median(x[metric] for x in row["runs"])
        for label, row in rows.items():
            if label.startswith("qkv") and "qkv bf16" in rows:
                row["speed_vs_qkv_bf16"] = speed(w, row[metric], rows["qkv bf16"][metric])
            twin = "vllm " + label.split(" ", 1)[1]
            if label.startswith("qkv") and twin in rows:
                row["speed_vs_" + twin.replace(" ", "_")] = speed(w, row[metric], rows[twin][metric])
            if label == "vllm fp8" and "vllm bf16" in rows:
                row["speed_vs_vllm_bf16"] = speed(w, row[metric], rows["vllm bf16"][metric])
        if "qkv bf16" in rows and "vllm bf16" in rows:
            a, b = rows["qkv bf16"]["token_ids_head"], rows["vllm bf16"]["token_ids_head"]
            report.setdefault("bf16_greedy_agreement", {})[w] = sum(x == y for x, y in zip(a, b)) / len(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="qkv without --compile-model (vLLM compiles either way)")
    ap.add_argument(
        "--vllm-python", default=str(default_vllm_python()), help="the vLLM venv's python ('' to run qkv alone)"
    )
    ap.add_argument("-o", "--output", default=str(ROOT / "eval/results/bench/vllm_compare_smollm2.json"))
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    if bad := [w for w in workloads if w not in WORKLOADS]:
        raise SystemExit(f"unknown workload {bad[0]!r}; choose from {', '.join(WORKLOADS)}")
    if args.vllm_python and not Path(args.vllm_python).exists():
        raise SystemExit(
            f"{args.vllm_python} does not exist: run `bash scripts/vllm_venv.sh`, or pass --vllm-python ''"
        )
    model = str(resolve_model(args.model))
    cpu = cpu_info()
    fp8_ok = vllm_fp8_supported()
    report: dict = {
        "model": args.model,
        "workloads": {
            w: dict(zip(("requests", "prompt_len", "output_len", "kv_mib"), WORKLOADS[w])) for w in workloads
        },
        "repeats": args.repeats,
        "env": {
            "cpu": cpu,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "qkv_commit": source_commit(ROOT),  # at the start: the code the engines loaded
            "load_average_before": os.getloadavg(),
        },
        "qkv_compile_model": not args.eager,
        "vllm_fp8_supported": fp8_ok,
        "vllm_fp8_note": None if fp8_ok else "vLLM's CPU backend needs AVX-512 or AMX for an fp8 KV cache: not run",
        "vllm_starts": [],
        "results": {},
    }
    for kv_mib in sorted({WORKLOADS[w][3] for w in workloads}):
        run_group(args, model, [w for w in workloads if WORKLOADS[w][3] == kv_mib], kv_mib, report)
    report["env"]["load_average_after"] = os.getloadavg()
    summarize(report)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
