"""Engine statistics, updated every step, and vLLM-style periodic log lines."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["EngineStats", "LOG_INTERVAL_S", "StatsLogger"]


@dataclass
class EngineStats:
    """Counters since start plus gauges of the last step (what ``/metrics`` and ``-v`` show)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_alloc_failures: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    # No per-request history here: a server runs for weeks. Latency distributions are
    # Prometheus histograms (``qkv.server.metrics``); each request's own are in its RequestMetrics.

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def snapshot(self) -> dict:
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_usage": self.kv_usage,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "num_preemptions": self.num_preemptions,
            "num_alloc_failures": self.num_alloc_failures,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_steps": self.num_steps,
        }


LOG_INTERVAL_S = 10.0  # seconds between stats lines: vLLM's default


class StatsLogger:
    """Prints one line every ``interval`` seconds, like vLLM's ``LoggingStatLogger``."""

    def __init__(self, interval: float = LOG_INTERVAL_S, log=print) -> None:
        self.interval = interval
        self.log = log
        self._last = time.monotonic()
        self._last_prompt = 0
        self._last_gen = 0

    def maybe_log(self, stats: EngineStats, force: bool = False) -> str | None:
        now = time.monotonic()
        dt = now - self._last
        if not force and dt < self.interval:
            return None
        dt = max(dt, 1e-9)
        line = (
            f"Avg prompt throughput: {(stats.prompt_tokens - self._last_prompt) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(stats.generation_tokens - self._last_gen) / dt:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * stats.kv_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * stats.prefix_cache_hit_rate:.1f}%, "
            f"Preemptions: {stats.num_preemptions}"
        )
        self._last, self._last_prompt, self._last_gen = now, stats.prompt_tokens, stats.generation_tokens
        self.log(line)
        return line
