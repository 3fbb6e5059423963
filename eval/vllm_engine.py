"""A vLLM engine in its own venv, driven from qkv's: generation, prompt logprobs and the scales it holds.

vLLM pins other versions of transformers and much else, so it runs in a venv of its own
(``bash scripts/vllm_venv.sh`` makes ``.venv-vllm``). :class:`VllmEngine` starts ``eval/vllm_worker.py`` there
(imports nothing of qkv) and talks to it over a pipe, one JSON line each way: the benchmark against vLLM
(scripts/bench_vllm.py) and the interop tests (tests/vllm) use it, so that what they measure or check is
vLLM's own process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["VllmEngine", "VllmError", "default_vllm_python", "vllm_fp8_supported"]

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


class VllmError(RuntimeError):
    """vLLM failed to start or to answer; the message is vLLM's."""


def default_vllm_python() -> Path:
    """``$QKV_VLLM_PYTHON``, else the venv scripts/vllm_venv.sh makes beside the checkout."""
    env = os.environ.get("QKV_VLLM_PYTHON")
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def vllm_fp8_supported() -> bool:
    """vLLM's CPU backend keeps an fp8 cache only on x86 with AVX-512 or AMX."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512f" in flags or "amx_tile" in flags


class VllmEngine:
    """One ``vllm.LLM`` in a worker process; ``spec`` holds eval/vllm_worker.py's keys (model, kv_cache_dtype,
    kv_bytes, max_model_len, enforce_eager, pipeline_parallel_size, ...)."""

    def __init__(self, spec: dict[str, Any], python: str | Path | None = None, log=None) -> None:
        python = Path(python) if python else default_vllm_python()
        if not python.exists():
            raise VllmError(f"{python} does not exist: run `bash scripts/vllm_venv.sh` (or set QKV_VLLM_PYTHON)")
        self.spec = spec
        # qkv's test settings are not vLLM's: Triton's interpreter and a one-thread rerun would slow or break it
        env = {
            k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
        }
        # pause() can freeze the engine core while it waits on its worker (the empty step that follows a finished
        # request), and that wait's deadline is on the monotonic clock, which runs on under SIGSTOP: frozen past
        # vLLM's default 300 s, the engine would die on resume with "RPC call to execute_model timed out".
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(7 * 24 * 3600))
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log if log is not None else sys.stderr,
            text=True,
            env=env,
            start_new_session=True,  # its own process group (vLLM's engine core and workers too): see pause()
        )
        self.info = self._read()
        if "error" in self.info:
            self.close()
            raise VllmError(f"vLLM did not start ({spec}): {self.info['error']}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            return {"error": f"the vLLM worker exited with {self.proc.wait()}"}
        return json.loads(line)

    def _ask(self, req: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        if "error" in r:
            raise VllmError(r["error"])
        return r

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """Greedy, ``ignore_eos``: (seconds of one ``LLM.generate``, the token ids of each prompt)."""
        r = self._ask({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return r["seconds"], r["token_ids"]

    def prompt_logprobs(self, windows: list[list[int]]) -> tuple[list[list[float]], list[list[tuple[int, float]]]]:
        """For each window, the logprob of every token after the first given the ones before it, and vLLM's
        most likely token there with its logprob."""
        r = self._ask({"cmd": "logprobs", "windows": windows})
        return r["token_logprobs"], [[(int(t), float(lp)) for t, lp in rows] for rows in r["top1"]]

    def kv_scales(self) -> list[list[dict]]:
        """Per worker process, every attention layer's ``{name, k_scale, v_scale, kv_cache_dtype}``."""
        return self._ask({"cmd": "scales"})["scales"]

    def pause(self) -> None:
        """Stop every process of this engine (SIGSTOP to its process group) until :meth:`resume`.

        An idle vLLM is not idle: its processes wake up often (measured with ``top``: about 6 % of a core each),
        and on a machine of two cores those wake-ups delay the threads of whatever else runs, which wait for each
        other at every parallel region. A benchmark freezes the engines it is not timing, so each runs alone."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
