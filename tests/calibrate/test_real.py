"""SmolLM2-135M calibrated on WikiText-2 validation: a real model through the whole path (slow)."""

import json

import pytest
import torch

from qkv import LLM
from qkv.calibrate.checkpoint import write_checkpoint
from qkv.calibrate.data import load_rows
from qkv.calibrate.run import calibrate
from qkv.data_files import WIKITEXT_VALID
from qkv.sampling import SamplingParams
from qkv.scoring import prefill_logits


@pytest.mark.slow
def test_smollm2_fp8_head_calibration_serves(tmp_path, data_file):
    wiki_valid = data_file(WIKITEXT_VALID)

    cal = calibrate(
        "smollm2-135m",
        raw=load_rows(str(wiki_valid)),
        kv_cache_dtype="fp8",
        strategy="head",
        observer="minmax",
        num_samples=2,
        seq_len=128,
        progress=False,
    )
    assert len(cal.layers) == 30 and all(r.k_scale.shape == (3,) for r in cal.layers)
    # SmolLM2's keys are far larger than its values (RoPE'd K with outlier dims)
    assert max(r.k_observed_amax.max() for r in cal.layers) > max(r.v_observed_amax.max() for r in cal.layers)
    out = write_checkpoint(cal, tmp_path / "smol-fp8-head")
    rec = json.loads((out / "calibration.json").read_text())
    assert rec["dataset"]["format"] == "text" and rec["tokens"] == 256

    fp8 = LLM(str(out), kv_cache_dtype="fp8", num_blocks=24)
    for r in cal.layers:
        assert torch.equal(fp8.llm_engine.cache.layers[r.layer].k_scale, r.k_scale)
    ids = fp8.get_tokenizer()("The capital of France is", add_special_tokens=True)["input_ids"]
    text = fp8.generate(ids, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].text
    assert "Paris" in text
    # calibrated fp8 logits stay close to the bf16 cache's
    ref = LLM("smollm2-135m", num_blocks=24)
    seq = ids * 6
    a = prefill_logits(fp8.llm_engine, seq).log_softmax(-1)
    b = prefill_logits(ref.llm_engine, seq).log_softmax(-1)
    kl = (b.exp() * (b - a)).sum(-1).mean().item()
    assert kl < 0.05
