"""TTFT, decode time per output token and KV memory, every configuration timed in one process.

Measurements are interleaved: for each repeat and each prompt length, every
configuration runs once before the next repeat starts, so drifts of the machine
(other processes, thermal state) hit all configurations alike; the order rotates
from repeat to repeat. Every
configuration gets exactly the same token ids. Medians of the repeats are
reported, and ratios to the baseline are taken per repeat (``ratio_range`` is
their min..max, what ``--compare`` uses as the interval).

* TTFT, cold: a prompt never seen by that engine (no prefix-cache hit), ``max_tokens=1``.
* TTFT, warm: the same prompt again right after, so every full block is a prefix-cache hit.
* Decode: ``batch`` prompts of ``decode_prompt_len`` tokens, ``decode_tokens`` tokens each;
  time per decode step after every sequence has its first token (one step = one
  output token for each sequence).
* Memory: KV bytes per token and how many sequences of ``memory_len`` tokens fit
  in ``kv_budget`` bytes (blocks of ``block_size``, one null block, as the engine plans).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from qkv.config import parse_size
from qkv.kv_cache import bytes_per_block
from qkv.sampling import SamplingParams

__all__ = ["measure_latency", "median_ratio", "memory_metrics", "random_prompts", "rotate_order", "run_requests"]

logger = logging.getLogger("qkv.eval")


def random_prompts(vocab: int, n: int, length: int, seed: int, avoid: set[int]) -> list[list[int]]:
    """``n`` reproducible random prompts of ``length`` ids, with ``avoid`` (EOS) ids replaced."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append([t if t not in avoid else 3 for t in ids])
    return out


def run_requests(
    engine, prompts: list[list[int]], max_tokens: int, on_step: Callable[[], None] | None = None
) -> tuple[float, float, int, list]:
    """(time until every sequence has its first token, total time, decode steps after that, outputs).

    ``on_step`` is called after every engine step (the throughput benchmark samples
    the number of running sequences there).
    """
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict = {}
    t_first: float | None = None
    steps_after = 0
    while len(done) < len(ids):
        outs = engine.step()
        if on_step is not None:
            on_step()
        now = time.perf_counter()
        if t_first is not None:
            steps_after += 1
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = o
        if t_first is None and len(first) == len(ids):
            t_first = now
    return t_first - t0, time.perf_counter() - t0, steps_after, [done[i] for i in ids]


def rotate_order(labels: list[str], r: int) -> list[str]:
    """Start each repeat with another configuration, so going first (caches, warm-up) is not always one's."""
    k = r % len(labels)
    return labels[k:] + labels[:k]


def _stats(values: list[float], base: list[float] | None) -> dict:
    out = {"median_ms": 1000 * statistics.median(values), "values_ms": [1000 * v for v in values]}
    if base is not None:
        ratios = [v / b for v, b in zip(values, base)]
        out["ratio"] = statistics.median(values) / statistics.median(base)
        out["ratio_range"] = [min(ratios), max(ratios)]
    return out


def measure_latency(
    engines: dict,
    baseline: str,
    ttft_lengths: list[int],
    repeats: int,
    decode_batches: list[int],
    decode_prompt_len: int,
    decode_tokens: int,
    seed: int = 0,
) -> dict:
    """All latency numbers, keyed by configuration label."""
    labels = list(engines)
    avoid = set().union(*(e.eos_token_ids for e in engines.values()))
    vocab = min(e.vocab_size for e in engines.values())
    # warm-up: first calls allocate and trace; discard them
    warm = random_prompts(vocab, 1, 32, seed + 999, avoid)
    for label in labels:
        run_requests(engines[label], warm, 2)
    cold = {L: {k: [] for k in labels} for L in ttft_lengths}
    hot = {L: {k: [] for k in labels} for L in ttft_lengths}
    cached = {L: {} for L in ttft_lengths}
    for r in range(repeats):
        for L in ttft_lengths:
            prompt = random_prompts(vocab, 1, L, seed + 1000 * r + L, avoid)
            for label in rotate_order(labels, r):
                t, _, _, _ = run_requests(engines[label], prompt, 1)
                cold[L][label].append(t)
                t, _, _, outs = run_requests(engines[label], prompt, 1)
                hot[L][label].append(t)
                cached[L][label] = outs[0].num_cached_tokens
            logger.info(
                "TTFT repeat %d, %d tokens: %s",
                r + 1,
                L,
                ", ".join(f"{k} {1000 * cold[L][k][-1]:.0f}/{1000 * hot[L][k][-1]:.0f} ms" for k in labels),
            )
    decode = {b: {k: [] for k in labels} for b in decode_batches}
    for r in range(repeats):
        for b in decode_batches:
            prompts = random_prompts(vocab, b, decode_prompt_len, seed + 7 + 100 * r + b, avoid)
            for label in rotate_order(labels, r):
                t_first, total, steps, _ = run_requests(engines[label], prompts, decode_tokens)
                decode[b][label].append((total - t_first) / max(steps, 1))
            logger.info(
                "decode repeat %d, batch %d: %s",
                r + 1,
                b,
                ", ".join(f"{k} {1000 * decode[b][k][-1]:.1f} ms/token" for k in labels),
            )
    out: dict = {}
    for label in labels:
        base = None if label == baseline else baseline
        out[label] = {
            "ttft": {
                str(L): {
                    "cold": _stats(cold[L][label], cold[L][base] if base else None),
                    "prefix_hit": _stats(hot[L][label], hot[L][base] if base else None),
                    "cached_tokens": cached[L][label],
                }
                for L in ttft_lengths
            },
            "decode_per_token": {
                str(b): _stats(decode[b][label], decode[b][base] if base else None) for b in decode_batches
            },
        }
        for b in decode_batches:
            d = out[label]["decode_per_token"][str(b)]
            d["tokens_per_s"] = b / (d["median_ms"] / 1000)
    return out


def memory_metrics(engine, kv_budget: str | int, memory_len: int) -> dict:
    """KV bytes per token and maximum concurrent sequences of ``memory_len`` tokens in ``kv_budget``."""
    budget = parse_size(kv_budget)
    per_block = bytes_per_block(engine.layer_specs, engine.block_size)
    usable = max(budget // per_block - 1, 0)
    per_seq = -(-memory_len // engine.block_size)
    return {
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "kv_bytes_per_token_by_layer": engine.kv_bytes_per_token_by_layer(),
        "kv_budget_bytes": budget,
        "memory_len": memory_len,
        "block_size": engine.block_size,
        "max_concurrent_seqs": int(usable // per_seq),
        "max_tokens_in_budget": int(usable * engine.block_size),
    }


def median_ratio(values: dict[str, list[float]], base: str) -> dict[str, float]:
    """Ratio of each label's median to ``base``'s median."""
    return {k: statistics.median(v) / statistics.median(values[base]) for k, v in values.items()}
