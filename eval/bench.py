"""``qkv bench``: what an 8-bit cache buys in speed, every cache dtype measured side by side in one run.

Three modes, all writing one JSON file whose ratios the README quotes:

* ``throughput``: ``--num-requests`` random prompts of ``--prompt-len`` tokens, ``--output-len``
  tokens each, submitted at once to one engine per cache dtype with the same
  ``--kv-cache-memory``. Output tokens/s, preemptions, peak running sequences and
  the KV budget in tokens; ratios to the first dtype (the baseline). ``--fits-all`` adds the
  baseline dtype once more with a pool that holds every request at once (label ``@fits-all``):
  the ceiling that KV capacity alone can reach on this workload and machine.
* ``latency``: for each ``--batch-sizes`` entry, the time until every sequence of the
  batch has its first token (TTFT of the batch) and the decode rate after it, in one
  run of ``--output-len`` tokens, for every dtype and for
  ``transformers.generate`` on the same weights and token ids (and, where qkv multiplies
  a 16-bit model in fp32, transformers under the same arithmetic: eval/bench_transformers.py);
  ratios to the first dtype and to transformers.
* ``prefix``: TTFT of a ``--prefix-len``-token prompt on a cold cache, then of the same
  prefix plus 4 new tokens (a prefix-cache hit); ``cold / hit`` per dtype, and the
  cold TTFT (a batch-1 prefill) against the baseline's. With ``--kv-offloading-size``,
  every free block is then evicted from the device pool through the real eviction path
  (so the prefix goes to the offload tier), and the same prompt is timed again: a tier
  hit. With ``--kv-offloading-dir`` too, each dtype runs twice, with the tier in RAM
  (label ``+ram``) and in files (``+file``), side by side. The tier is emptied at the
  start of every repeat, so the cold run is cold (``--kv-offloading-dir`` is emptied too).

``throughput`` with ``--kv-offloading-size`` measures what the write-through tier costs: every dtype runs
with prefix caching on, once without a tier (its plain label) and once with it (``+ram``, and ``+file``
with ``--kv-offloading-dir``), the prefix cache and the tier emptied before every run so that nothing
is a hit; ``ratio_to_tier_off`` is the tier's cost (or gain: a preempted sequence may reload its
blocks from the tier instead of recomputing them).

Every engine shares one copy of the weights, runs are interleaved (each repeat runs
every dtype once, in rotating order) so drifts of the machine hit all alike, and
the load average before and after is recorded: numbers measured on a busy machine
say so in the file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.config import EngineConfig
from qkv.config_flags import ENGINE_FLAG_FIELDS
from qkv.engine import LLMEngine
from qkv.kernels.cpu_attention import CpuKernels
from qkv.offload import evict_free_blocks
from qkv.options import Checked, option
from qkv.sequence import RequestOutput

from .bench_throughput import fits_all_engine, throughput
from .bench_transformers import load_baselines
from .configs import EvalConfig, parse_configs
from .latency import median_ratio, random_prompts, rotate_order, run_requests
from .machine import cpu_info

__all__ = ["BenchOptions", "BENCH_ENGINE_FIELDS", "run_bench", "MODES"]

MODES = ("throughput", "latency", "prefix")
# bench sets the two engine fields it measures itself: the cache dtype (one engine per --kv-cache-dtypes entry)
# and prefix caching (on in prefix mode, and in throughput mode with a tier, which needs it; off in the other
# runs: they repeat their prompts, and a hit would time nothing).
BENCH_ENGINE_FIELDS = tuple(f for f in ENGINE_FLAG_FIELDS if f not in ("kv_cache_dtype", "enable_prefix_caching"))


@dataclass
class BenchOptions(Checked):
    """``qkv bench``'s options; the engine's are EngineConfig's (:data:`BENCH_ENGINE_FIELDS`)."""

    mode: str = option(
        "latency",
        "throughput, latency or prefix; prefix caching is on in prefix mode, and with an offload tier",
        choices=MODES,
    )
    kv_cache_dtypes: list[str] = option(
        help="comma-separated eval configurations, DTYPE[:SCALES][+skip=...]; the first is the baseline",
        default_factory=lambda: ["bfloat16", "fp8"],
        sep=",",
    )
    # The defaults are the decode-heavy budget row (48 x (128 + 256)): a prefill-bound workload cannot show what
    # KV capacity buys, since prefill costs the same whatever the cache holds (docs/benchmarks.md).
    num_requests: int = option(48, "throughput: requests submitted at once", ge=1)
    prompt_len: int = option(128, "prompt tokens per request", ge=1)
    output_len: int = option(256, "output tokens per request", ge=2)
    batch_sizes: list[int] = option(help="latency: batch sizes", default_factory=lambda: [1, 16], sep=",")
    fits_all: bool = option(
        False,
        "throughput: also run the first dtype with a KV pool that holds every request at once "
        "(label @fits-all): what capacity alone can buy",
    )
    prefix_len: int = option(2048, "prefix: tokens of the shared prefix", ge=1)
    repeats: int = option(3, "interleaved repeats of every measurement", ge=1)
    seed: int = option(0, "seed of the random prompts")
    transformers: bool = option(True, "latency: time transformers.generate on the same weights too")
    output: str = option("bench_results/bench.json", "where the JSON goes", short="-o")


def _tier_variants(engine_kwargs: dict, mode: str) -> list[tuple[str, dict]]:
    """(label suffix, kwargs): one engine per dtype, or with ``--kv-offloading-dir`` a RAM and a file tier;
    in throughput mode with a tier, first the same engine without one (the tier's cost is the ratio)."""
    if engine_kwargs.get("kv_offloading_size") is None:
        return [("", engine_kwargs)]
    off = [("", {**engine_kwargs, "kv_offloading_size": None, "kv_offloading_dir": None})]
    tiers = [("+ram", {**engine_kwargs, "kv_offloading_dir": None})]
    if engine_kwargs.get("kv_offloading_dir") is not None:
        tiers.append(("+file", engine_kwargs))
    if mode == "throughput":
        return off + tiers
    return tiers if len(tiers) > 1 else [("", engine_kwargs)]


def _engines(model: str, configs: list[EvalConfig], engine_kwargs: dict, mode: str) -> dict[str, LLMEngine]:
    engines: dict[str, LLMEngine] = {}
    shared = None
    for cfg in configs:
        for suffix, variant in _tier_variants(engine_kwargs, mode):
            kwargs = {**variant, **cfg.engine_kwargs()}
            engine = LLMEngine(EngineConfig(model=model, **kwargs), preloaded_model=shared)
            shared = engine.model
            engines[cfg.label + suffix] = engine
    return engines


def _latency(engines: dict[str, LLMEngine], args, vocab: int, avoid: set[int]) -> dict:
    first = next(iter(engines.values()))
    hf = load_baselines(first, random_prompts(vocab, 1, 16, args.seed + 999, avoid)) if args.transformers else {}
    labels = list(engines) + list(hf)
    out: dict = {}
    for b in args.batch_sizes:
        ttft: dict[str, list[float]] = {k: [] for k in labels}
        rate: dict[str, list[float]] = {k: [] for k in labels}
        for r in range(args.repeats):
            prompts = random_prompts(vocab, b, args.prompt_len, args.seed + 100 * r + b, avoid)
            for label in rotate_order(labels, r):
                if label in hf:
                    t_first, total = hf[label].run(prompts, args.output_len)
                else:
                    t_first, total = run_requests(engines[label], prompts, args.output_len)[:2]
                ttft[label].append(t_first)
                rate[label].append(b * (args.output_len - 1) / max(total - t_first, 1e-9))
            print(
                f"latency batch {b} repeat {r + 1}: "
                + ", ".join(f"{k} TTFT {1000 * ttft[k][-1]:.0f} ms, {rate[k][-1]:.1f} tok/s" for k in labels),
                flush=True,
            )
        base = labels[0]
        row = {}
        for label in labels:
            row[label] = {
                "ttft_ms": 1000 * statistics.median(ttft[label]),
                "decode_tokens_per_s": statistics.median(rate[label]),
                "ttft_ms_runs": [1000 * t for t in ttft[label]],
                "decode_tokens_per_s_runs": rate[label],
            }
            row[label]["decode_ratio_to_" + base] = median_ratio(rate, base)[label]
            row[label]["ttft_ratio_to_" + base] = median_ratio(ttft, base)[label]
            if hf:
                row[label]["decode_ratio_to_transformers"] = median_ratio(rate, "transformers")[label]
                row[label]["ttft_ratio_to_transformers"] = median_ratio(ttft, "transformers")[label]
        out[f"batch_{b}"] = row
    return out


def _tier_hit(engine: LLMEngine, prompt: list[int]) -> tuple[float, RequestOutput, dict]:
    """Evict the device copy of ``prompt``'s blocks (they go to the tier), then time ``prompt`` again."""
    assert engine.offload is not None
    t0 = time.perf_counter()
    evict_free_blocks(engine.pool)
    evict_s = time.perf_counter() - t0
    before = engine.offload.counters()
    t_tier, _, _, outs = run_requests(engine, [prompt], 1)
    after = engine.offload.counters()
    delta = {
        k: after[k] - before[k]
        for k in (
            "kv_offload_load_seconds",
            "kv_offload_bytes_read",
            "kv_offload_loaded_blocks",
            "external_prefix_cache_hits",
        )
    }
    return t_tier, outs[0], {"evict_seconds": evict_s, **delta}


def _prefix(engines: dict[str, LLMEngine], args, vocab: int, avoid: set[int]) -> dict:
    labels = list(engines)
    cold: dict[str, list[float]] = {k: [] for k in labels}
    hit: dict[str, list[float]] = {k: [] for k in labels}
    tier: dict[str, list[float]] = {k: [] for k in labels if engines[k].offload is not None}
    tier_runs: dict[str, list[dict]] = {k: [] for k in tier}
    cached: dict[str, int] = {}
    for r in range(args.repeats):
        prefix = random_prompts(vocab, 1, args.prefix_len, args.seed + 7 + r, avoid)[0]
        suffix = random_prompts(vocab, 1, 4, args.seed + 70 + r, avoid)[0]
        for label in rotate_order(labels, r):
            engine = engines[label]
            engine.pool.reset_prefix_cache()
            if engine.offload is not None:
                engine.offload.clear()
            t_cold = run_requests(engine, [prefix], 1)[0]
            t_hit, _, _, outs = run_requests(engine, [prefix + suffix], 1)
            cold[label].append(t_cold)
            hit[label].append(t_hit)
            cached[label] = outs[0].num_cached_tokens
            if engine.offload is not None:
                t_tier, tier_out, info = _tier_hit(engine, prefix + suffix)
                tier[label].append(t_tier)
                tier_runs[label].append(
                    {
                        "ttft_ms": 1000 * t_tier,
                        "cached_tokens": tier_out.num_cached_tokens,
                        "same_token_as_device_hit": tier_out.outputs[0].token_ids == outs[0].outputs[0].token_ids,
                        **info,
                    }
                )
        print(
            f"prefix repeat {r + 1}: "
            + ", ".join(
                f"{k} cold {1000 * cold[k][-1]:.0f} ms / hit {1000 * hit[k][-1]:.1f} ms"
                + (f" / tier hit {1000 * tier[k][-1]:.1f} ms" if k in tier else "")
                for k in labels
            ),
            flush=True,
        )
    base = labels[0]
    cold_ratio = median_ratio(cold, base)
    out = {
        label: {
            "cold_ttft_ms": 1000 * statistics.median(cold[label]),
            "hit_ttft_ms": 1000 * statistics.median(hit[label]),
            "cold_over_hit": statistics.median([c / h for c, h in zip(cold[label], hit[label])]),
            "cold_ttft_ratio_to_" + base: cold_ratio[label],
            "cached_tokens": cached[label],
            "cold_ttft_ms_runs": [1000 * t for t in cold[label]],
            "hit_ttft_ms_runs": [1000 * t for t in hit[label]],
        }
        for label in labels
    }
    for label, times in tier.items():
        runs = tier_runs[label]
        out[label].update(
            {
                "tier_hit_ttft_ms": 1000 * statistics.median(times),
                "tier_hit_over_cold": statistics.median([t / c for t, c in zip(times, cold[label])]),
                "tier_load_ms": 1000 * statistics.median(x["kv_offload_load_seconds"] for x in runs),
                "tier_load_share_of_ttft": statistics.median(
                    x["kv_offload_load_seconds"] / t for x, t in zip(runs, times)
                ),
                "tier_cached_tokens": runs[-1]["cached_tokens"],
                "tier_hit_tokens": runs[-1]["external_prefix_cache_hits"],
                "tier_bytes_read": runs[-1]["kv_offload_bytes_read"],
                "tier_runs": runs,
            }
        )
    return out


def _kernel_build_seconds(engine: LLMEngine) -> float | None:
    """Seconds a first call spends compiling the CPU kernels (a fresh build, timed apart from the runs)."""
    if engine.backend.name != "cpu":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        CpuKernels.build(Path(tmp))
        return time.perf_counter() - t0


def run_bench(model: str, args: BenchOptions, engine_kwargs: dict) -> dict:
    """Run ``args.mode`` for every configuration in ``args.kv_cache_dtypes`` (eval configuration syntax)."""
    configs = parse_configs(",".join(args.kv_cache_dtypes))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k in BENCH_ENGINE_FIELDS}
    tier = engine_kwargs.get("kv_offloading_size") is not None
    engine_kwargs["enable_prefix_caching"] = args.mode == "prefix" or tier  # see BENCH_ENGINE_FIELDS
    if args.mode == "latency" and tier:
        raise ValueError("--kv-offloading-size: the offload tier is measured by --mode prefix and throughput")
    fits_all = args.fits_all
    if fits_all and args.mode != "throughput":
        raise ValueError("--fits-all: only --mode throughput has a KV budget to lift")
    engines = _engines(model, configs, engine_kwargs, args.mode)
    if fits_all:
        shared = next(iter(engines.values())).model
        engines[configs[0].label + "@fits-all"] = fits_all_engine(model, configs[0], engine_kwargs, args, shared)
    setup = time.perf_counter() - t0
    first = next(iter(engines.values()))
    avoid = set().union(*(e.eos_token_ids for e in engines.values()))
    warm = random_prompts(first.vocab_size, 1, 16, args.seed + 999, avoid)
    for engine in engines.values():  # first calls allocate; keep them out of the numbers
        run_requests(engine, warm, 2)
    mode = {"throughput": throughput, "latency": _latency, "prefix": _prefix}[args.mode]
    results = mode(engines, args, first.vocab_size, avoid)
    cpu = cpu_info()
    report = {
        "mode": args.mode,
        "model": model,
        "dtype": str(first.dtype).replace("torch.", ""),
        "device": str(first.device),
        "attention_backend": first.backend.name,
        "cpu_matmul": first.cpu_matmul,
        "configs": [c.to_json() for c in configs],
        "baseline": configs[0].label,
        "params": {
            k: getattr(args, k)
            for k in ("num_requests", "prompt_len", "output_len", "batch_sizes", "prefix_len", "repeats", "seed")
        },
        "engine": engine_kwargs,
        "setup_seconds": setup,
        "kernel_build_seconds": _kernel_build_seconds(first),
        "results": results,
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": cpu["name"],
            "cpu_flags": cpu["flags"],
            "threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report
