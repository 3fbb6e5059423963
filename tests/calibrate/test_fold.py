"""export-vllm --fold: K smoothing and V rotation folded into the weights leave the model's function unchanged.

The folded checkpoint computes the same logits as the original (fp32: to rounding; bf16: to bf16 rounding),
its K channels are divided by s and its V rotated (so the cache holds other values), and the smoothing
scales keep RoPE's pairs equal. The CLI writes a plain compressed-tensors fp8 checkpoint, per tensor.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from qkv import LLM, SamplingParams
from qkv.calibrate.fold import fold_weights, smoothing_scales
from qkv.cli import main
from qkv.scales import read_kv_scales


def test_smoothing_scales_keep_rope_pairs_equal_with_unit_geometric_mean():
    amax = torch.rand(3, 16) * 10 + 0.1
    s = smoothing_scales(amax, 0.5)
    assert s.shape == (3, 16) and torch.equal(s[:, :8], s[:, 8:])
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(3), atol=1e-6, rtol=0)
    pair = torch.maximum(amax[:, :8], amax[:, 8:])
    ratio = pair.sqrt() / s[:, :8]  # s is max|K|^0.5 up to one factor per head
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
    assert torch.equal(smoothing_scales(amax, 0.0), torch.ones(3, 16))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_folded_model_computes_the_original_logits(tiny_dir, tmp_path, dtype, tol):
    src = tmp_path / "src"
    AutoModelForCausalLM.from_pretrained(str(tiny_dir("llama")), dtype=dtype).save_pretrained(src)
    for f in tiny_dir("llama").iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special"):
            (src / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(0)
    k_amax = {i: torch.rand(2, 16, generator=g) * 8 + 0.5 for i in range(3)}
    record = fold_weights(src, tmp_path / "folded", k_amax, alpha=0.5)
    assert record["layers"] == 3 and record["v_rotation"] == "hadamard"
    ids = torch.tensor([[1, 5, 9, 33, 70, 12, 200, 7, 3, 44, 81, 2]])
    models = [AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype) for p in (src, tmp_path / "folded")]
    with torch.no_grad():
        a, b = (m(ids).logits.float() for m in models)
    assert (a - b).abs().max().item() <= tol * a.abs().max().item()
    # and the weights did change: K rows scaled, V rotated
    wa, wb = (m.model.layers[0].self_attn for m in models)
    assert not torch.equal(wa.k_proj.weight, wb.k_proj.weight) and not torch.equal(wa.v_proj.weight, wb.v_proj.weight)


def test_cli_writes_a_per_tensor_fp8_checkpoint_qkv_serves(tiny_dir, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys and values. " * 80)
    out = tmp_path / "folded-fp8"
    argv = [
        "export-vllm",
        str(tiny_dir("llama")),
        "--fold",
        "--alpha",
        "0.5",
        "--fold-v-rotation",
        "--fold-rounding",
        "nearest",
        "--dataset",
        str(text),
        "--num-samples",
        "4",
        "--seq-len",
        "32",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    scales = read_kv_scales(out)
    assert scales.kind == "float" and scales.strategy == "tensor" and sorted(scales.k) == [0, 1, 2]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert (cfg["type"], cfg["strategy"], cfg["num_bits"]) == ("float", "tensor", 8)
    calib = json.loads((out / "calibration.json").read_text())
    assert calib["fold"]["k_smoothing"]["alpha"] == 0.5 and calib["fold"]["v_rotation"] == "hadamard"
    llm = LLM(str(out), dtype="float32", kv_cache_dtype="fp8", num_blocks=32)
    assert len(llm.generate(["The quick"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids) == 4
    assert calib["fold"]["rounding"] == "nearest" and calib["fold"]["rounding_compensation"] is None
    assert "qkv_rounding_compensation" not in json.loads((out / "config.json").read_text())
    assert main(["export-vllm", str(tiny_dir("llama")), "--fold", "-o", str(tmp_path / "x")]) == 2  # no --dataset
    no_rounding = ["export-vllm", str(tiny_dir("llama")), "--fold", "--dataset", str(text), "-o", str(tmp_path / "y")]
    assert main(no_rounding) == 2 and not (tmp_path / "y").exists()
