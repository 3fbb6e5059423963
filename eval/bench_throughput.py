"""``qkv bench --mode throughput``: every request submitted at once to one engine per cache dtype at a fixed
``--kv-cache-memory``, and with ``--fits-all`` the ceiling that KV capacity alone can reach.

Output tokens/s are the output tokens of every request over the wall time of the whole run (prefill,
preemption and recompute included), the number a serving user sees; the preemptions and the peak of
running sequences say why one dtype beats another.

With an offload tier (``+ram``/``+file`` labels beside the tier-off engine of the same dtype), the prefix
cache and the tier are emptied before each run, and each run records the blocks the write-through stored
and skipped; ``ratio_to_tier_off`` compares each tier engine with its tier-off twin.
"""

from __future__ import annotations

import dataclasses
import statistics

from qkv.config import EngineConfig
from qkv.engine import LLMEngine

from .configs import EvalConfig
from .latency import median_ratio, random_prompts, rotate_order, run_requests

__all__ = ["fits_all_engine", "throughput"]

_TIER_COUNTS = ("kv_offload_stored_blocks", "kv_offload_skipped_blocks", "kv_offload_loaded_blocks")


def _tier_delta(before: dict, after: dict) -> dict:
    """What one run did to the tier: blocks stored (write-through), skipped (writer behind) and loaded."""
    return {k.removeprefix("kv_offload_"): after[k] - before[k] for k in (*_TIER_COUNTS, "kv_offload_store_seconds")}


def fits_all_engine(model: str, base: EvalConfig, engine_kwargs: dict, args, shared) -> LLMEngine:
    """The baseline dtype with a pool that holds every request whole at once: no preemption, all running.

    Its throughput is what KV capacity alone can buy at this workload: a cache dtype that doubles the
    budget approaches it, and passes it only by attending faster than the baseline."""
    config = EngineConfig(model=model, **{**engine_kwargs, **base.engine_kwargs()})
    if config.max_num_seqs < args.num_requests:
        raise ValueError(f"--fits-all: --max-num-seqs must be at least --num-requests ({args.num_requests})")
    per_request = -(-(args.prompt_len + args.output_len) // config.block_size)
    config = dataclasses.replace(config, num_blocks=args.num_requests * per_request + 1)  # + the null block
    return LLMEngine(config, preloaded_model=shared)


def throughput(engines: dict[str, LLMEngine], args, vocab: int, avoid: set[int]) -> dict:
    prompts = random_prompts(vocab, args.num_requests, args.prompt_len, args.seed, avoid)
    labels = list(engines)
    runs: dict[str, list[dict]] = {k: [] for k in labels}
    for r in range(args.repeats):
        for label in rotate_order(labels, r):
            engine = engines[label]
            engine.pool.reset_prefix_cache()  # prefix caching is on with a tier: no run may hit an earlier one
            tier = engine.offload
            if tier is not None:
                tier.clear()  # flushes the previous run's queued writes first, outside the timing
            tier0 = tier.counters() if tier is not None else None
            preempt0 = engine.scheduler.num_preemptions
            peak = 0

            def on_step(e=engine):
                nonlocal peak
                peak = max(peak, len(e.scheduler.running))

            _, total, _, outs = run_requests(engine, prompts, args.output_len, on_step=on_step)
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[label].append(
                {
                    "seconds": total,
                    "output_tokens_per_s": out_tokens / total,
                    "preemptions": engine.scheduler.num_preemptions - preempt0,
                    "peak_running": peak,
                    **({} if tier is None or tier0 is None else _tier_delta(tier0, tier.counters())),
                }
            )
            engine.pool.check_no_leaks()
            print(
                f"throughput repeat {r + 1} {label}: {out_tokens / total:.1f} output tok/s, "
                f"{runs[label][-1]['preemptions']} preemptions, peak {peak} running",
                flush=True,
            )
    base = labels[0]
    rates = {k: [x["output_tokens_per_s"] for x in v] for k, v in runs.items()}
    ratio = median_ratio(rates, base)
    tier_off = {k: k.removesuffix("+ram").removesuffix("+file") for k in labels if engines[k].offload is not None}
    return {
        label: {
            "output_tokens_per_s": statistics.median(rates[label]),
            "ratio_to_" + base: ratio[label],
            **({"ratio_to_tier_off": median_ratio(rates, tier_off[label])[label]} if label in tier_off else {}),
            "kv_budget_tokens": (engines[label].cache.num_blocks - 1) * engines[label].block_size,
            "kv_bytes_per_token": engines[label].kv_bytes_per_token,
            "runs": runs[label],
        }
        for label in labels
    }
