"""A real Prometheus scrapes ``qkv serve`` during a short load, and its HTTP API holds what the load sent.

The Prometheus is the Debian ``prometheus`` package (``.ci/run`` installs it), started here on a
loopback port with a one-second scrape interval. What is checked is what a user's Prometheus would
see: the target is up with no scrape error, each family has the type it claims, the counters equal
the counts the load produced, and every query of the committed Grafana dashboard
(``docs/grafana/qkv-dashboard.json``) parses and returns data for the served model.
"""

import json
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.server import ServerProcess, family_sum, free_port

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "qkv-dashboard.json"
NAME = "tiny"
PROMPTS, PROMPT_LEN, MAX_TOKENS = 3, 64, 8  # 64 tokens: 4 full blocks, 3 of them hits when sent again
ENGINE = {"dtype": "float32", "kv_cache_dtype": "fp8", "num_blocks": 128, "max_model_len": 512}
TIER = ["--kv-offloading-size", "0.01", "--served-model-name", NAME]
HITS = PROMPTS * (PROMPT_LEN - 16)  # the second round: each prompt's first 3 blocks (the last token is computed)


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:  # a failure, not a skip: CI installs it (.ci/run), so this test can never pass by skipping
        pytest.fail("no `prometheus` on PATH: install the Debian package (apt-get install prometheus)")
    return found


class Prometheus:
    """A Prometheus server scraping ``target`` every second, with its data in ``workdir``."""

    def __init__(self, target: str, workdir: Path) -> None:
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: qkv\n    static_configs:\n      - targets: ['{target}']\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait(lambda: httpx.get(self.url + "/-/ready", timeout=2).status_code == 200, "ready")

    def api(self, path: str, **params) -> object:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]

    def value(self, query: str) -> float | None:
        """The instant value of a query that yields one series (None: no series)."""
        result = self.api("query", query=query)["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except (httpx.HTTPError, AssertionError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: {what} not reached in {timeout} s; log: {self.log.name}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def dashboard_queries(model: str) -> list[str]:
    """Every PromQL expression of the dashboard's panels, with its variables set as Grafana sets them."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    return [e.replace("$model_name", model).replace("$__rate_interval", "1m") for e in exprs]


def send_load(srv: ServerProcess) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    client = srv.openai()
    for p in prompts + prompts:  # the second round finds the first's blocks in the prefix cache
        out = client.completions.create(
            model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == MAX_TOKENS


def test_a_real_prometheus_scrapes_the_load_it_was_sent(tiny_dir, tmp_path, record):
    srv = ServerProcess(model=str(tiny_dir("llama")), engine=ENGINE, extra=TIER)
    prom = Prometheus(f"127.0.0.1:{srv.port}", tmp_path)
    try:
        prom.wait(lambda: prom.value('up{job="qkv"}') == 1, "first scrape")
        send_load(srv)
        server_side = srv.metrics()  # the load is over: these are the final values
        requests = 2 * PROMPTS
        expected = [  # (family, labels besides model_name, value)
            ("qkv:request_success_total", {"finished_reason": "length"}, requests),
            ("qkv:generation_tokens_total", {}, requests * MAX_TOKENS),
            ("qkv:prefix_cache_queries_total", {}, requests * PROMPT_LEN),
            ("qkv:prefix_cache_hits_total", {}, HITS),
            ("qkv:prompt_tokens_total", {}, requests * PROMPT_LEN - HITS),
            ("qkv:external_prefix_cache_queries_total", {}, requests * PROMPT_LEN),
            ("qkv:external_prefix_cache_hits_total", {}, 0),  # the device pool held every repeated block
            ("qkv:kv_offload_stored_blocks_total", {}, PROMPTS * PROMPT_LEN // 16),  # write-through, once a block
            ("qkv:kv_offload_skipped_blocks_total", {}, 0),
            ("qkv:kv_offload_bad_entries_total", {}, 0),
            ("qkv:e2e_request_latency_seconds_count", {}, requests),
            ("qkv:kv_cache_usage_perc", {}, 0.0),  # idle: no request holds a block
            ("qkv:num_requests_running", {}, 0),
        ]
        for family, labels, want in expected:
            selector = family + "{" + ",".join(f'{k}="{v}"' for k, v in {"model_name": NAME, **labels}.items()) + "}"
            prom.wait(lambda s=selector, w=want: prom.value(s) == w, f"{selector} == {want}")
            assert family_sum(server_side, family, **labels) == want, family
        hit_rate = f'sum(qkv:prefix_cache_hits_total{{model_name="{NAME}"}})'
        hit_rate += f' / sum(qkv:prefix_cache_queries_total{{model_name="{NAME}"}})'
        assert prom.value(hit_rate) == HITS / (requests * PROMPT_LEN) == 0.375

        # the scrape itself: healthy, and every family typed as qkv declares it
        (target,) = prom.api("targets")["activeTargets"]
        assert (target["health"], target["lastError"]) == ("up", "")
        meta = prom.api("metadata")
        types = {name: entries[0]["type"] for name, entries in meta.items() if name.startswith("qkv:")}
        assert types["qkv:request_success_total"] == types["qkv:kv_offload_stored_blocks_total"] == "counter"
        assert types["qkv:kv_cache_usage_perc"] == types["qkv:kv_offload_write_queue_bytes"] == "gauge"
        assert types["qkv:time_to_first_token_seconds"] == "histogram"

        # the dashboard: every metric it names is scraped, every query parses and has data
        names = set(prom.api("label/__name__/values"))
        queries = dashboard_queries(NAME)
        used = {m for q in queries for m in re.findall(r"qkv:[A-Za-z0-9_:]+", q)}
        assert len(queries) >= 15 and used <= names, sorted(used - names)
        for q in queries:  # a rate needs two samples of a series, which the next scrapes bring
            prom.wait(lambda q=q: bool(prom.api("query", query=q)["result"]), f"data for {q}")
        version = prom.api("status/buildinfo")["version"]
        record(f"Prometheus {version}: {len(names)} metric names scraped, {len(queries)} dashboard queries answered")
    finally:
        prom.stop()
        srv.stop()
