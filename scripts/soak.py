"""Soak benchmark: ``qkv serve`` under a bounded loop of mixed requests, measured minute by minute.

Starts ``qkv serve`` on 127.0.0.1 (a free port), measures it idle, then runs ``--concurrency`` client
threads for ``--duration`` seconds. Each thread loops over a seeded mix of requests: streamed completions
and chats read to the end, streams the client drops after two chunks, plain completions that the client
abandons after 0.3 s, long prompts sharing a prefix (prefix-cache hits), and bad bodies (1,000-deep
nesting, lone surrogates, broken JSON, out-of-range fields, unknown model). Every 5 s it samples the
server's RSS and open file descriptors (``/proc``) and KV blocks held (``/debug/kv``). After the load it
waits for the server to go idle and samples again. It writes a JSON file and a figure:

* per minute: requests by status, p50/p99 end-to-end latency of completed requests, RSS, descriptors
  and KV blocks held (last sample and maximum), load average;
* the checks: RSS growth after the first minute, descriptors and blocks back to their idle values,
  and the number of responses >= 500.

Usage (the README's run)::

    python scripts/soak.py --duration 600 --out eval/results/soak

Latencies depend on what else runs on the machine; the load average is recorded for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

SERVE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "fp8",
    "--kv-cache-memory",
    "64MiB",
    "--max-model-len",
    "1024",
    "--disable-uvicorn-access-log",
    "--log-interval",
    "60",
]
SYSTEM = (
    "You are a helpful assistant of a public library. Answer in at most two sentences and recommend at most one book. "
) * 12  # ~250 tokens shared by the long prompts
TOPICS = ["the ocean", "volcanoes", "castles", "bees", "the moon", "jazz", "chess", "rainforests", "Rome", "owls"]
BAD_BODIES = [
    b"[" * 1000 + b"]" * 1000,
    b'{"model": "\\ud800", "prompt": "hi"}',
    b'{"prompt": "hi \\udc00"}',
    b'{"prompt": ',
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "max_tokens": 1000000000}',
    b'{"prompt": "hi", "seed": 1180591620717411303424}',
    b'{"prompt": "hi", "top_k": 1.5}',
    b'{"model": "gpt-17", "prompt": "hi"}',
    b'{"messages": "hi"}',
    b"\xff\xfe",
]
KINDS = ["stream", "chat_stream", "drop_stream", "abandon", "long_prompt", "bad_body"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, flags: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.log = open(log_path, "w")  # noqa: SIM115 - the server writes it until stop() closes it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qkv.cli", "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"qkv serve exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("qkv serve did not come up in 600 s")
            time.sleep(0.5)

    def sample(self) -> dict:
        pid = self.proc.pid
        fds = len(os.listdir(f"/proc/{pid}/fd"))  # before this sample's own connection opens
        rss_kib = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        kv = httpx.get(self.url + "/debug/kv", timeout=60).json()
        return {
            "t": time.monotonic(),
            "rss_mib": rss_kib / 1024,
            "fds": fds,
            "blocks_held": kv["num_referenced_blocks"],
            "blocks_cached": kv["num_cached_blocks"],
            "unfinished": kv["num_unfinished_requests"],
        }

    def wait_idle(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(1.0)  # lets the server close the connections of requests that just ended
            s = self.sample()
            if s["blocks_held"] == 0 and s["unfinished"] == 0:
                return s
            if time.monotonic() > deadline:
                return s

    def stop(self) -> int:
        self.proc.terminate()
        rc = self.proc.wait(120)
        self.log.close()
        return rc


class Load:
    """Client threads; each finished request is recorded as (end time, kind, status, latency s)."""

    def __init__(self, url: str, concurrency: int, seed: int) -> None:
        self.url = url
        self.records: list[tuple[float, str, int, float]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.worker, args=(seed + i,), daemon=True) for i in range(concurrency)]

    def record(self, kind: str, status: int, t0: float) -> None:
        with self.lock:
            self.records.append((time.monotonic(), kind, status, time.monotonic() - t0))

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self.stop.is_set():
                kind = rng.choice(KINDS)
                t0 = time.monotonic()
                try:
                    status = getattr(self, kind)(client, rng)
                except httpx.TimeoutException:
                    status = 499  # the client gave up (abandon): the server aborts the request
                except httpx.HTTPError:
                    status = -1  # a transport error: connection reset, incomplete chunked read...
                self.record(kind, status, t0)

    def stream(self, client, rng) -> int:
        body = {"prompt": f"Tell me about {rng.choice(TOPICS)}.", "max_tokens": rng.randint(8, 32), "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        return r.status_code if lines and lines[-1] == "data: [DONE]" else -2

    def chat_stream(self, client, rng) -> int:
        body = {
            "messages": [{"role": "user", "content": f"What is special about {rng.choice(TOPICS)}?"}],
            "max_tokens": rng.randint(8, 32),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        return r.status_code if lines and lines[-1] == "data: [DONE]" else -2

    def drop_stream(self, client, rng) -> int:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break  # leaving the block closes the connection mid-stream
        return r.status_code

    def abandon(self, client, rng) -> int:
        client.post(
            "/v1/completions",
            json={"prompt": "Write a long story.", "max_tokens": 300, "ignore_eos": True},
            timeout=0.3,
        )
        return 200  # not reached unless the server answered within 0.3 s

    def long_prompt(self, client, rng) -> int:
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"A book about {rng.choice(TOPICS)}?"},
            ],
            "max_tokens": rng.randint(4, 16),
        }
        return client.post("/v1/chat/completions", json=body).status_code

    def bad_body(self, client, rng) -> int:
        r = client.post(
            rng.choice(["/v1/completions", "/v1/chat/completions"]),
            content=rng.choice(BAD_BODIES),
            headers={"Content-Type": "application/json"},
        )
        return r.status_code


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def summarize(samples: list[dict], records: list, t_start: float, duration: float) -> list[dict]:
    minutes = []
    for m in range(int(-(-duration // 60))):
        lo, hi = t_start + 60 * m, t_start + 60 * (m + 1)
        recs = [r for r in records if lo <= r[0] < hi]
        smp = [s for s in samples if lo <= s["t"] < hi] or [min(samples, key=lambda s: abs(s["t"] - hi))]
        done = [r[3] for r in recs if r[2] == 200 and r[1] not in ("drop_stream", "bad_body")]
        status: dict[str, int] = {}
        for r in recs:
            status[str(r[2])] = status.get(str(r[2]), 0) + 1
        minutes.append(
            {
                "minute": m + 1,
                "requests": len(recs),
                "by_status": dict(sorted(status.items())),
                "p50_latency_s": percentile(done, 50),
                "p99_latency_s": percentile(done, 99),
                "rss_mib": round(smp[-1]["rss_mib"], 1),
                "rss_mib_max": round(max(s["rss_mib"] for s in smp), 1),
                "fds": smp[-1]["fds"],
                "fds_max": max(s["fds"] for s in smp),
                "blocks_held": smp[-1]["blocks_held"],
                "blocks_held_max": max(s["blocks_held"] for s in smp),
                "loadavg_1m": smp[-1].get("loadavg_1m"),
            }
        )
    return minutes


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["samples"][0]["t"]
    ts = [(s["t"] - t0) / 60 for s in result["samples"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    series = [("rss_mib", "server RSS (MiB)"), ("fds", "open file descriptors"), ("blocks_held", "KV blocks held")]
    for ax, (key, title) in zip(axes.flat, series):
        ax.plot(ts, [s[key] for s in result["samples"]], lw=1)
        ax.axhline(result["idle_before"][key], color="gray", ls="--", lw=0.8, label="idle before the load")
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=8)
    ax = axes.flat[3]
    mins = result["minutes"]
    ax.plot([m["minute"] - 0.5 for m in mins], [m["p99_latency_s"] for m in mins], "o-", label="p99")
    ax.plot([m["minute"] - 0.5 for m in mins], [m["p50_latency_s"] for m in mins], "s-", label="p50")
    ax.set_title("end-to-end latency per minute (s)")
    ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    c = result["checks"]
    fig.suptitle(
        f"qkv serve soak: {result['total_requests']} requests, {c['responses_5xx']} responses >= 500, "
        f"RSS {c['rss_growth_after_first_minute_pct']:+.2f}% after minute 1",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 10 minutes)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="eval/results/soak", help="folder for soak.json and soak.png")
    ap.add_argument("--serve-flags", default=" ".join(SERVE_FLAGS), help="flags for qkv serve")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = args.serve_flags.split()
    log_path = Path(tempfile.gettempdir()) / "qkv-soak-server.log"
    server = Server(args.model, flags, log_path)
    samples: list[dict] = []
    try:
        httpx.post(server.url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=300)
        idle_before = server.wait_idle()
        load = Load(server.url, args.concurrency, args.seed)
        t_start = time.monotonic()
        for t in load.threads:
            t.start()
        while time.monotonic() - t_start < args.duration:
            s = server.sample()
            s["loadavg_1m"] = os.getloadavg()[0]
            samples.append(s)
            time.sleep(5)
        load.stop.set()
        for t in load.threads:
            t.join(600)
        idle_after = server.wait_idle()
        samples.append({**idle_after, "loadavg_1m": os.getloadavg()[0]})
        health = httpx.get(server.url + "/health", timeout=30).status_code
    finally:
        rc = server.stop()
    records = load.records
    minutes = summarize(samples, records, t_start, args.duration)
    rss_minute1 = minutes[0]["rss_mib"]
    rss_end = idle_after["rss_mib"]
    five_xx = sum(1 for r in records if r[2] >= 500)
    transport_errors = sum(1 for r in records if r[2] < 0)
    by_kind: dict[str, dict[str, int]] = {}
    for _, kind, status, _ in records:
        by_kind.setdefault(kind, {}).setdefault(str(status), 0)
        by_kind[kind][str(status)] += 1
    server_log = log_path.read_text(errors="replace")
    result = {
        "command": "python scripts/soak.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "serve_flags": flags,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "cpu_count": os.cpu_count(),
        "loadavg_start_end": [samples[0]["loadavg_1m"], samples[-1]["loadavg_1m"]],
        "total_requests": len(records),
        "by_kind_and_status": by_kind,
        "idle_before": {k: idle_before[k] for k in ("rss_mib", "fds", "blocks_held", "blocks_cached")},
        "idle_after": {k: idle_after[k] for k in ("rss_mib", "fds", "blocks_held", "blocks_cached")},
        "minutes": minutes,
        "checks": {
            "rss_mib_end_of_minute_1": rss_minute1,
            "rss_mib_end": round(rss_end, 1),
            "rss_growth_after_first_minute_pct": round(100 * (rss_end - rss_minute1) / rss_minute1, 2),
            "rss_mib_max_after_first_minute": max(m["rss_mib_max"] for m in minutes[1:]) if minutes[1:] else None,
            "rss_max_growth_after_first_minute_pct": round(
                100 * (max(m["rss_mib_max"] for m in minutes[1:]) - rss_minute1) / rss_minute1, 2
            )
            if minutes[1:]
            else None,
            "fds_idle_before": idle_before["fds"],
            "fds_idle_after": idle_after["fds"],
            "blocks_held_idle_before": idle_before["blocks_held"],
            "blocks_held_idle_after": idle_after["blocks_held"],
            "responses_5xx": five_xx,
            "transport_errors": transport_errors,
            "health_after": health,
            "tracebacks_in_server_log": server_log.count("Traceback"),
            "server_exit_code": rc,
        },
        "samples": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()} for s in samples],
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "soak.png")
    print(json.dumps(result["checks"], indent=1))


if __name__ == "__main__":
    main()
