"""qkv eval on SmolLM2-135M: calibrated fp8 passes a perplexity gate, the same scales / 64 fail it.

Two windows of 256 tokens are a small sample (calibrated fp8 measured +1.3% on them),
so the gate is 5%; scales / 64 saturate nearly every K/V value and move perplexity by orders of magnitude.
"""

from __future__ import annotations

import json

import pytest
from support.scales import observe_amax, write_scales_dir

from qkv import LLM
from qkv.cli import main
from qkv.data_files import WIKITEXT_TEST, WIKITEXT_VALID
from qkv.eval import data
from qkv.registry import resolve_model

pytestmark = pytest.mark.slow


def test_gate_on_smollm2(tmp_path, capsys, data_file):
    data_file(WIKITEXT_TEST)  # what --dataset wikitext (the default) reads
    model = str(resolve_model("smollm2-135m"))
    engine = LLM(model, kv_cache_memory="64MiB").llm_engine
    # calibrate on a slice of the *validation* split (never the test split)
    valid = data_file(WIKITEXT_VALID).read_text(encoding="utf-8-sig")
    k, v = observe_amax(engine, data.make_windows(engine.tokenizer, valid[:60000], 2, 512))
    calib = write_scales_dir(tmp_path / "calib", k, v)
    broken = write_scales_dir(tmp_path / "div64", k, v, divide=64.0)
    out = tmp_path / "rep"
    code = main(
        [
            "eval",
            model,
            "--configs",
            f"bf16,fp8:{calib},fp8:{broken}",
            "--num-windows",
            "2",
            "--window",
            "256",
            "--ttft-lengths",
            "none",
            "--max-ppl-delta",
            "5%",
            "--report",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1, printed
    r = json.loads((out / "report.json").read_text())
    assert r["verdicts"]["fp8:calib"]["verdict"] == "PASS"
    assert r["verdicts"]["fp8:div64"]["verdict"] == "FAIL"
    assert r["accuracy"]["fp8:div64"]["ppl_delta_pct"] > 100.0
    assert "FAIL fp8:div64" in printed
