"""Prometheus metrics of one server, named like vLLM's ``vllm:`` families under ``qkv:``.

Each app gets its own :class:`CollectorRegistry` (tests run several servers).
Engine counters and gauges are read at scrape time from the last snapshot the
engine thread published; latency histograms are observed by the engine thread
as outputs come out of ``step()``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..offload import OFFLOAD_COUNTERS, OFFLOAD_GAUGES

__all__ = ["ServerMetrics", "snapshot_engine"]

# vLLM's bucket boundaries.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def snapshot_engine(engine) -> dict:
    """Counters and gauges of ``engine`` right now (call on the engine thread only)."""
    st = engine.stats
    return {
        **(engine.offload.counters() if engine.offload is not None else {}),
        "num_requests_running": len(engine.scheduler.running),
        "num_requests_waiting": len(engine.scheduler.waiting),
        "kv_cache_usage_perc": engine.pool.usage(),
        "kv_shared_blocks": engine.pool.num_shared_blocks(),
        "kv_cow_copies": engine.kv_manager.num_copies,
        "prefix_cache_queries": st.prefix_cache_queries,
        "prefix_cache_hits": st.prefix_cache_hits,
        "num_preemptions": st.num_preemptions,
        "prompt_tokens": st.prompt_tokens,
        "generation_tokens": st.generation_tokens,
    }


_GAUGES = {
    "num_requests_running": "Number of requests in the running batch.",
    "num_requests_waiting": "Number of requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks held by requests (1 = full).",
    "kv_shared_blocks": "KV-cache blocks held by more than one sequence (e.g. parallel samples of a prompt).",
}
_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache, once per admitted request.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache, once per admitted request.",
    "kv_cow_copies": "Copy-on-write block copies (a sample's first write into a shared partly filled block).",
    "num_preemptions": "Preemptions (recompute) since start.",
    "prompt_tokens": "Prefill tokens computed (prefix-cache hits excluded).",
    "generation_tokens": "Generated tokens.",
}


class _EngineCollector:
    def __init__(self, source, labels: dict[str, str]) -> None:
        self.source = source  # () -> latest snapshot dict
        self.labels = labels

    def collect(self):
        snap = self.source() or {}
        names, values = list(self.labels), list(self.labels.values())
        for key, doc in {**_GAUGES, **OFFLOAD_GAUGES}.items():
            g = GaugeMetricFamily(f"qkv:{key}", doc, labels=names)
            g.add_metric(values, float(snap.get(key, 0)))
            yield g
        for key, doc in {**_COUNTERS, **OFFLOAD_COUNTERS}.items():
            c = CounterMetricFamily(f"qkv:{key}", doc, labels=names)
            c.add_metric(values, float(snap.get(key, 0)))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self._source = dict
        self.registry.register(_EngineCollector(lambda: self._source(), labels))
        lab = ["model_name"]
        self.ttft = Histogram(
            "qkv:time_to_first_token_seconds", "Time to first token.", lab, buckets=TTFT_BUCKETS, registry=self.registry
        ).labels(model_name)
        self.itl = Histogram(
            "qkv:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            lab,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "qkv:e2e_request_latency_seconds",
            "Arrival to last token.",
            lab,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            "qkv:request_success",
            "Finished requests by finish reason.",
            lab + ["finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def watch(self, source) -> None:
        """Read engine counters and gauges from ``source()`` (a snapshot dict) at scrape time."""
        self._source = source

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
