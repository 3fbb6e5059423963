"""lm-eval's own ``local-completions`` model against a real ``qkv serve`` equals ``qkv lm-eval`` in-process.

The client is lm-eval's, run as its CLI runs it (``python -m lm_eval run`` in a subprocess): it sends
lists of token-id prompts with ``echo``, ``logprobs: 1`` and ``max_tokens: 1`` and sums the echoed
prompt logprobs of each continuation. An fp32 model and an fp32 cache on both sides, so the per-choice
loglikelihoods agree within 1e-4. Needs the ``lm-eval`` extra (``lm-eval[api]``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.server import THREAD_ENV, ServerProcess

from qkv.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # the in-process run; the subprocesses get THREAD_ENV


def _loglikelihoods(out_dir) -> dict[int, list[float]]:
    (samples,) = list(out_dir.rglob("samples_qkv_mc_*.jsonl"))
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return {d["doc_id"]: [float(r[0]) for r in d["filtered_resps"]] for d in docs}


def _served(model: str, out_dir, tasks_dir) -> None:
    """Start ``qkv serve`` and run lm-eval's CLI against it (on a thread, beside the in-process run)."""
    server = ServerProcess(model, {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 512}, api_key=None)
    try:
        args = (
            f"model={model},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model},tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=512"
        )
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "lm_eval",
                "run",
                "--model",
                "local-completions",
                "--model_args",
                args,
                "--tasks",
                "qkv_mc",
                "--include_path",
                str(tasks_dir),
                "--output_path",
                str(out_dir),
                "--log_samples",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-4000:] + "\n--- server ---\n" + server.log_tail()
        assert server.wait_idle()["num_referenced_blocks"] == 0
    finally:
        server.stop()


def test_local_completions_through_qkv_serve_equals_in_process(tiny_dir, tmp_path, monkeypatch):
    from qkv.eval.lm_eval_model import TASKS_DIR

    model = str(tiny_dir("llama"))
    for k, v in {**THREAD_ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(k, v)
    with ThreadPoolExecutor(1) as pool:
        served_run = pool.submit(_served, model, tmp_path / "served", TASKS_DIR)
        code = main(
            [
                "lm-eval",
                "--model_args",
                f"pretrained={model},dtype=float32,kv_cache_memory=16MiB",
                "--tasks",
                "qkv_mc",
                "--output_path",
                str(tmp_path / "local"),
                "--log_samples",
            ]
        )
        served_run.result()
    assert code == 0
    local, served = _loglikelihoods(tmp_path / "local"), _loglikelihoods(tmp_path / "served")

    assert sorted(served) == sorted(local) and len(local) >= 4
    for doc_id, lls in local.items():
        assert len(served[doc_id]) == len(lls) >= 2
        assert served[doc_id] == pytest.approx(lls, abs=1e-4), doc_id
