"""export-vllm --fold-rounding toward-zero: the factors that undo a truncating fp8 cache write, and their fold.

vLLM 0.32's CPU backend rounds its e4m3 cache writes toward zero (eval/results/vllm/fp8_rounding.json). The
emulated write gives exactly the bytes vLLM was measured to store; the factors are the least-squares fit
read off calibration histograms, equal to the fit over the raw values; the fold multiplies exactly the
query rows and o_proj columns of each kv head's group and leaves K and V, so the exported scales are those
of a plain per-tensor calibration, bit for bit.
"""

import json

import torch
from transformers import AutoModelForCausalLM

from qkv import LLM
from qkv.calibrate.fold import fold_weights
from qkv.calibrate.rounding import compensation, e4m3_toward_zero
from qkv.calibrate.stats import TensorStats
from qkv.cli import main
from qkv.scales import read_kv_scales


def test_toward_zero_gives_the_bytes_vllm_stores():
    x = torch.tensor([1.09375, 1.1875, -1.09375, 440.0, 0.0029296875, 500.0, -1e6, 0.0, 448.0, 2.0**-9 * 0.99])
    want = [1.0, 1.125, -1.0, 416.0, 0.001953125, 448.0, -448.0, 0.0, 448.0, 0.0]
    assert e4m3_toward_zero(x).tolist() == want
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3_toward_zero(codes), codes) and torch.equal(e4m3_toward_zero(-codes), -codes)
    below = torch.nextafter(codes[1:], torch.zeros(()))  # just under each code: the one below it
    assert torch.equal(e4m3_toward_zero(below), codes[:-1])


def test_factors_from_histograms_equal_the_least_squares_fit_of_the_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 3, 64, generator=g) * torch.tensor([0.02, 1.0, 30.0])[None, :, None]
    stats = TensorStats(3)
    stats.update(x)
    scale = float(x.abs().max()) / 448
    c = compensation(stats, scale, "toward-zero")
    for h in range(3):
        a = x[:, h].flatten().double()
        b = (e4m3_toward_zero(x[:, h].flatten() / scale) * scale).double()
        assert abs(c[h].item() - (a @ a / (a @ b)).item()) < 2e-3
    assert torch.all((c > 1.02) & (c < 1.07))  # half an e4m3 step, on average
    assert torch.equal(compensation(stats, scale, "nearest"), torch.ones(3))


def test_fold_scales_query_rows_and_o_proj_columns_per_group_only(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    cfg = json.loads((src / "config.json").read_text())
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // hq
    comp = {i: (torch.tensor([2.0, 0.5]), torch.tensor([4.0, 0.25])) for i in range(cfg["num_hidden_layers"])}
    record = fold_weights(src, tmp_path / "out", None, 0.0, rotate_v=False, compensate=comp)
    assert record["k_smoothing"] is None and record["rounding_compensation"]["1"] == {"k": [2.0, 0.5], "v": [4.0, 0.25]}
    a, b = (AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32) for p in (src, tmp_path / "out"))
    group = hq // hkv
    for la, lb in zip(a.model.layers, b.model.layers):
        sa, sb = la.self_attn, lb.self_attn
        rows = torch.tensor([2.0] * (group * d) + [0.5] * (group * d))
        cols = torch.tensor([4.0] * (group * d) + [0.25] * (group * d))
        assert torch.equal(sb.q_proj.weight, sa.q_proj.weight * rows[:, None])
        assert torch.equal(sb.o_proj.weight, sa.o_proj.weight * cols[None, :])
        for name in ("k_proj", "v_proj"):
            assert torch.equal(getattr(sb, name).weight, getattr(sa, name).weight)


def test_cli_folds_factors_and_keeps_the_plain_per_tensor_scales(tiny_dir, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys and values. " * 80)
    data = ["--dataset", str(text), "--num-samples", "4", "--seq-len", "32"]
    model = str(tiny_dir("llama"))
    fold = ["export-vllm", model, "--fold", "--alpha", "0", "--no-fold-v-rotation", "--fold-rounding", "toward-zero"]
    assert main([*fold, *data, "-o", str(tmp_path / "fold")]) == 0
    assert main(["calibrate", model, *data, "--kv-cache-dtype", "fp8", "--no-progress", "-o", str(tmp_path / "p")]) == 0
    folded, plain = read_kv_scales(tmp_path / "fold"), read_kv_scales(tmp_path / "p")
    for i in plain.k:
        assert torch.equal(folded.k[i], plain.k[i]) and torch.equal(folded.v[i], plain.v[i])
    rec = json.loads((tmp_path / "fold/calibration.json").read_text())["fold"]
    assert rec["rounding"] == "toward-zero" and rec["v_rotation"] is None and rec["k_smoothing"] is None
    factors = [x for r in rec["rounding_compensation"].values() for x in r["k"] + r["v"]]
    assert len(factors) == 3 * 2 * 2 and all(1.0 < x < 1.125 for x in factors)  # under one e4m3 step
    cfg = json.loads((tmp_path / "fold/config.json").read_text())
    want = {"target_rounding": "toward-zero", "layers": rec["rounding_compensation"]}
    assert cfg["qkv_rounding_compensation"] == want
    # a plain calibration of the folded checkpoint keeps the record (its weights keep the factors); a second
    # fold of it is refused
    again = tmp_path / "again"
    assert (
        main(["calibrate", str(tmp_path / "fold"), *data, "--kv-cache-dtype", "fp8", "--no-progress", "-o", str(again)])
        == 0
    )
    assert json.loads((again / "config.json").read_text())["qkv_rounding_compensation"] == want
    refold = [
        "export-vllm",
        str(tmp_path / "fold"),
        "--fold",
        "--fold-rounding",
        "nearest",
        *data,
        "-o",
        str(tmp_path / "re"),
    ]
    assert main(refold) == 2 and not (tmp_path / "re").exists()
    # qkv rounds to nearest: it divides the factors out on load, back to the original weights to rounding
    served = LLM(str(tmp_path / "fold"), dtype="float32", kv_cache_dtype="fp8", num_blocks=32).llm_engine.model
    original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for la, lb in zip(original.model.layers, served.model.layers):
        for name in ("q_proj", "o_proj"):
            wa, wb = getattr(la.self_attn, name).weight, getattr(lb.self_attn, name).weight
            torch.testing.assert_close(wb, wa, rtol=3e-7, atol=0)
