"""The engine's perplexity through lm-eval equals lm-eval's own `hf` model on the same local task.

fp32: within 1e-4 (measured: equal to the last printed digit under oneDNN's default, AVX512_CORE_BF16,
AVX512_CORE and AVX2 code paths on an Intel Xeon with AMX). bf16: within 1 %, since bf16 perplexity moves with
the arithmetic itself. Measured on the same two articles, word perplexity ranged over 45.13-45.36 (0.51 %)
across those four code paths x {qkv's fused CPU attention, its torch reference, transformers' SDPA} x {bf16,
fp32 GEMMs}; 1 % is twice that spread, and an engine bug (a position, mask or scale off) moves it by far more.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from qkv.data_files import WIKITEXT_TEST
from qkv.eval.lm_eval_model import QKVLM, TASKS_DIR
from qkv.registry import resolve_model

# exactness: .ci/run reruns these bounds at one thread and on AVX2 code paths
pytestmark = [pytest.mark.slow, pytest.mark.exactness]


@pytest.mark.parametrize("dtype,rel", [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_word_perplexity_matches_hf(tmp_path, monkeypatch, data_file, dtype, rel):
    src = data_file(WIKITEXT_TEST)
    spec = importlib.util.spec_from_file_location("qkv_task_data", TASKS_DIR / "qkv_task_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pages = mod.split_articles(src.read_text(encoding="utf-8"))[:2]
    # lm-eval's hf model takes log_softmax in the logits' dtype (bf16) unless softmax_dtype is set; qkv
    # scores in fp32, so the reference runs with softmax_dtype=float32 (the model itself stays in dtype).
    # two articles cut to ~1,500 characters at a line end: ~350 tokens each, one rolling window each
    short = [p[: p.rfind("\n", 0, 1500) + 1] for p in pages]
    data = tmp_path / "pages.jsonl"
    data.write_text("".join(json.dumps({"page": p}) + "\n" for p in short))
    monkeypatch.setenv("QKV_WIKITEXT_JSONL", str(data))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = str(resolve_model("smollm2-135m"))
    tm = TaskManager(include_path=str(TASKS_DIR))
    hf = simple_evaluate(
        model="hf",
        model_args=f"pretrained={path},dtype={dtype},softmax_dtype=float32,device=cpu",
        tasks=["qkv_wikitext"],
        task_manager=tm,
    )["results"]["qkv_wikitext"]
    qkv_lm = QKVLM(pretrained=path, dtype=dtype, kv_cache_memory="64MiB")  # the engine's defaults
    qkv = simple_evaluate(model=qkv_lm, tasks=["qkv_wikitext"], task_manager=tm)["results"]["qkv_wikitext"]
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        print(f"{dtype} {metric}: qkv {qkv[metric]:.6f}, hf {hf[metric]:.6f}")
        assert qkv[metric] == pytest.approx(hf[metric], rel=rel), (metric, qkv[metric], hf[metric])
