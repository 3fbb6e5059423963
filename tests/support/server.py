"""Helpers for the server tests: a real ``qkv serve`` subprocess and the offline reference outputs.

Both run with one intra-op thread: the CPU GEMMs give different last bits for
different thread counts, and two single-threaded processes share two cores well.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m"
API_KEY = "sk-qkv-test"
# The same engine flags for the server and the offline LLM. The server batches requests differently from
# LLM.generate, so outputs are only comparable bit for bit with --batch-invariant (one GEMM per sequence)
# and fp32 (CPU bf16 GEMMs change bits with the row count; fp32 ones only below 4 rows).
ENGINE = {
    "dtype": "float32",
    "kv_cache_dtype": "fp8",
    "batch_invariant": True,
    "kv_cache_memory": "256MiB",
    "max_model_len": 1024,
}
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def engine_flags(engine: dict) -> list[str]:
    out = []
    for k, v in engine.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v not in (False, None):
            out += [flag, str(v)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update(THREAD_ENV)
    env.pop("TRITON_INTERPRET", None)
    return env


class ServerProcess:
    """``python -m qkv.cli serve MODEL ...`` on a free loopback port; waits for /health."""

    def __init__(
        self,
        model: str = MODEL,
        engine: dict = ENGINE,
        extra: list[str] = (),
        api_key: str | None = API_KEY,
        startup_timeout: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # noqa below: the server writes the log for its whole life; stop() closes it
        self.log = tempfile.NamedTemporaryFile("w+", prefix="qkv-serve-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "qkv.cli",
            "serve",
            model,
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            *engine_flags(engine),
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up in {startup_timeout}s:\n{self.log_tail()}")
            time.sleep(0.5)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 300), **kw)

    def openai(self, asynchronous: bool = False):
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=600)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {series with labels: value}."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)

    def metric(self, name: str, **labels) -> float:
        """Sum of the series of family ``name`` whose labels include ``labels``."""
        return family_sum(self.metrics(), name, **labels)

    def kv(self) -> dict:
        return httpx.get(self.url + "/debug/kv", headers=self.headers, timeout=30).json()

    def wait_idle(self, timeout: float = 120.0) -> dict:
        """Poll /debug/kv until no request holds a block; returns the last report."""
        deadline = time.monotonic() + timeout
        while True:
            kv = self.kv()
            if kv["num_referenced_blocks"] == 0 and kv["num_unfinished_requests"] == 0:
                return kv
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still held after {timeout}s: {kv}")
            time.sleep(0.2)

    def terminate(self, timeout: float = 120.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_REFERENCE_SCRIPT = r"""
import json, sys
from qkv import LLM, SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"], **spec["engine"])
tok = llm.get_tokenizer()
prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
           if "messages" in r else r["prompt"] for r in spec["requests"]]
outs = llm.generate(prompts, [SamplingParams(**r["params"]) for r in spec["requests"]])
llm.llm_engine.pool.check_no_leaks()
json.dump([{"text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
            "finish_reason": o.outputs[0].finish_reason, "num_prompt_tokens": len(o.prompt_token_ids)}
           for o in outs], open(sys.argv[2], "w"))
"""


class OfflineReference:
    """``LLM.generate`` over ``requests`` in a subprocess, started now, collected by :meth:`result`.

    A request is ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered with the chat template,
    as the server does), plus ``"params"`` for :class:`SamplingParams`.
    """

    def __init__(self, requests: list[dict], model: str = MODEL, engine: dict = ENGINE) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="qkv-ref-")
        spec, self.out = Path(self.dir.name) / "spec.json", Path(self.dir.name) / "out.json"
        spec.write_text(json.dumps({"model": model, "engine": engine, "requests": requests}))
        self.log = open(Path(self.dir.name) / "log.txt", "w+")  # noqa: SIM115 - the child writes it until it exits
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _REFERENCE_SCRIPT, str(spec), str(self.out)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        self._result = None

    def result(self, timeout: float = 900.0) -> list[dict]:
        if self._result is None:
            rc = self.proc.wait(timeout)
            if rc != 0:
                self.log.seek(0)
                raise RuntimeError(f"offline reference failed ({rc}):\n{self.log.read()[-4000:]}")
            self._result = json.loads(self.out.read_text())
        return self._result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.dir.cleanup()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(values)
    return s[max(0, min(len(s), math.ceil(q / 100 * len(s))) - 1)]


@contextlib.asynccontextmanager
async def running_app(path: str, engine: dict | None = None, **app_kw):
    """The app in-process (httpx's ASGI transport) on the model at ``path``: yields (client, AsyncEngine)."""
    from qkv.config import EngineConfig
    from qkv.engine import LLMEngine
    from qkv.server.app import build_app
    from qkv.server.async_engine import AsyncEngine
    from qkv.server.metrics import ServerMetrics

    llm_engine = LLMEngine(EngineConfig(model=path, **(engine or {"dtype": "float32", "num_blocks": 64})))
    metrics = ServerMetrics("tiny")
    async_engine = AsyncEngine(llm_engine, metrics, log_stats=False)
    app = build_app(async_engine, ["tiny"], metrics, **app_kw)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as client:
            yield client, async_engine


def family_sum(metrics: dict[str, float], name: str, **labels) -> float:
    """Sum of the series of family ``name`` in a :func:`parse_metrics` dict whose labels include ``labels``."""
    total = 0.0
    for series, value in metrics.items():
        base, _, lab = series.partition("{")
        if base == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += value
    return total


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {series with labels: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
