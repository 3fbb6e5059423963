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


@pytest.mark.slow
def test_smollm2_int4_key_basis_halves_the_loss_of_clipping_alone(tmp_path, data_file):
    """Rotated int4 on SmolLM2: the calibrated key basis (K centred and smoothed against Q) leaves well under the
    mean KL to the unquantized cache that clipping ratios alone leave, on test windows the calibration never saw.
    Issue 25's eval measured 0.035 against 0.063 on 16 x 1,024 tokens; the bound is loose enough for a machine's
    rounding and a smaller calibration, and a basis that is not applied (or applied to K without Q) fails it."""
    from qkv.calibrate.checkpoint import write_scales_file
    from qkv.data_files import WIKITEXT_TEST

    raw = load_rows(str(data_file(WIKITEXT_VALID)))
    base = LLM("smollm2-135m", dtype="float32", kv_cache_memory="64MiB")
    ids = base.llm_engine.tokenizer(data_file(WIKITEXT_TEST).read_text()[:40000])["input_ids"]
    windows = [ids[i * 512 : (i + 1) * 512] for i in range(4)]
    ref = [torch.log_softmax(prefill_logits(base.llm_engine, w), -1) for w in windows]
    kl = {}
    for name, key_basis in (("clip", False), ("basis", True)):
        cal = calibrate(
            "smollm2-135m",
            raw=raw,
            kv_cache_dtype="int4_per_token_head",
            rotation="hadamard",
            key_basis=key_basis,
            num_samples=16,
            seq_len=256,
            progress=False,
        )
        assert (cal.bases is not None) == key_basis
        path = write_scales_file(cal, tmp_path / f"{name}.safetensors")
        llm = LLM(
            "smollm2-135m",
            preloaded_model=base.llm_engine.model,
            dtype="float32",
            kv_cache_memory="64MiB",
            kv_cache_dtype="int4_per_token_head",
            kv_scales=str(path),
        )
        lps = [torch.log_softmax(prefill_logits(llm.llm_engine, w), -1) for w in windows]
        kl[name] = sum(float((r.exp() * (r - lp)).sum(-1).mean()) for r, lp in zip(ref, lps)) / len(windows)
    print("mean KL to the unquantized cache:", kl)
    assert kl["basis"] < 0.75 * kl["clip"], kl
