"""Calibrated checkpoints: vLLM's view of the fp8 output, qkv's int8 section, round trips through the engine,
and reading what llm-compressor writes."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qkv.calibrate.checkpoint import FP8_SCALES_FILE, INDEX_FILE, write_checkpoint
from qkv.calibrate.data import Samples
from qkv.calibrate.run import calibrate
from qkv.scales import QKV_SCALES_FILE, read_kv_scales

CONFIGS = [("fp8", "tensor"), ("fp8", "head"), ("int8", "tensor"), ("int8", "head")]
ARCH = "llama"  # tiny: 3 layers, 2 kv heads, head_dim 16


def _chunks(n=3, length=40):
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 384, (length - 1,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def outputs(tiny_dir, tmp_path_factory):
    """One calibration per (dtype, strategy) of the tiny llama, written to its own directory."""
    base = tmp_path_factory.mktemp("calib")
    model = tiny_dir(ARCH)
    res = {}
    for dt, strategy in CONFIGS:
        cal = calibrate(
            str(model),
            samples=Samples(_chunks()),
            kv_cache_dtype=dt,
            strategy=strategy,
            observer="minmax",
            progress=False,
        )
        out = write_checkpoint(cal, base / f"{dt}-{strategy}")
        res[dt, strategy] = (cal, out)
    return res


def _weights(model: Path) -> dict:
    return load_file(str(model / "model.safetensors"))


def _vllm_kv_view(out: Path, num_layers: int, num_kv_heads: int) -> dict:
    """What vLLM's compressed-tensors path does with the directory: validate the scheme, load the tensors
    listed in the index, give every attention layer ``[1]`` or ``[num_kv_heads]`` scales (attn_head flattens)."""
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    QuantizationConfig.model_validate(qc)
    scheme = qc["kv_cache_scheme"]
    args = QuantizationArgs.model_validate(scheme)
    # vLLM CompressedTensorsConfig.validate_kv_cache_scheme
    assert scheme["type"] == "float" and scheme["num_bits"] == 8 and scheme["symmetric"] is True
    assert args.strategy in ("tensor", "attn_head") and args.dynamic is False
    n_scales = num_kv_heads if scheme["strategy"] == "attn_head" else 1
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    got = {}
    for name, file in index.items():
        with safe_open(str(out / file), framework="pt") as fh:
            assert name in fh.keys()  # noqa: SIM118 - a safetensors handle, not a dict
            if name.endswith(("k_scale", "v_scale")):
                t = fh.get_tensor(name)
                assert t.dtype == torch.float32 and t.flatten().numel() == n_scales
                got[name] = t.flatten()
    want = {f"model.layers.{i}.self_attn.{w}_scale" for i in range(num_layers) for w in "kv"}
    assert set(got) == want
    return got


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_fp8_output_is_what_vllm_reads(outputs, tiny_dir, strategy):
    cal, out = outputs["fp8", strategy]
    src = tiny_dir(ARCH)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["format"] == "dense"
    assert cfg["quantization_config"]["quantization_status"] == "compressed"
    assert cfg["quantization_config"]["config_groups"] == {}
    assert (
        cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == {"tensor": "tensor", "head": "attn_head"}[strategy]
    )
    assert "qkv_kv_cache" not in cfg
    got = _vllm_kv_view(out, num_layers=3, num_kv_heads=2)
    shape = (2,) if strategy == "head" else (1,)
    assert all(load_file(str(out / FP8_SCALES_FILE))[n].shape == shape for n in got)
    # weights untouched and nothing else added: the index lists the source tensors plus the scales
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    src_names = set(_weights(src))
    assert set(index) - src_names == set(got)
    w_out, w_src = _weights(out), _weights(src)
    assert w_out.keys() == w_src.keys() and all(torch.equal(w_out[k], w_src[k]) for k in w_src)
    assert os.path.samefile(out / "model.safetensors", src / "model.safetensors")  # hard link by default
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_int8_goes_in_the_qkv_section(outputs, strategy):
    cal, out = outputs["int8", strategy]
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg  # vLLM has no static int8 KV: no kv_cache_scheme for it
    sec = cfg["qkv_kv_cache"]
    assert sec["type"] == "int" and sec["strategy"] == strategy and sec["scales_file"] == QKV_SCALES_FILE
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert QKV_SCALES_FILE not in index.values()  # loaders following the index never see them
    t = load_file(str(out / QKV_SCALES_FILE))
    assert sorted(t) == sorted(f"model.layers.{i}.self_attn.{w}_scale" for i in range(3) for w in "kv")
    assert all(v.dtype == torch.float32 and v.shape == ((2,) if strategy == "head" else (1,)) for v in t.values())


@pytest.mark.parametrize("dt,strategy", CONFIGS)
def test_round_trip_bit_for_bit(outputs, tiny_dir, dt, strategy):
    from qkv import LLM

    cal, out = outputs[dt, strategy]
    scales = read_kv_scales(out)
    assert scales.kind == ("float" if dt == "fp8" else "int") and scales.strategy == strategy
    for r in cal.layers:
        assert torch.equal(scales.k[r.layer], r.k_scale.reshape(-1))
        assert torch.equal(scales.v[r.layer], r.v_scale.reshape(-1))
    file = out / (FP8_SCALES_FILE if dt == "fp8" else QKV_SCALES_FILE)
    alone = read_kv_scales(file)  # the scales file describes itself in its safetensors metadata
    assert (alone.kind, alone.strategy) == (scales.kind, scales.strategy)
    assert all(torch.equal(alone.k[i], scales.k[i]) for i in scales.k)
    for model, kw in (
        (str(out), {}),
        (str(tiny_dir(ARCH)), {"kv_scales": str(out)}),
        (str(tiny_dir(ARCH)), {"kv_scales": str(file)}),
    ):
        engine = LLM(model, kv_cache_dtype=dt, num_blocks=16, **kw).llm_engine
        for r in cal.layers:
            layer = engine.cache.layers[r.layer]
            assert torch.equal(layer.k_scale, r.k_scale.expand(2))
            assert torch.equal(layer.v_scale, r.v_scale.expand(2))


def test_calibration_json(outputs):
    cal, out = outputs["fp8", "head"]
    rec = json.loads((out / "calibration.json").read_text())
    for key in (
        "model",
        "dataset",
        "num_samples",
        "tokens",
        "observer",
        "percentile",
        "seed",
        "kv_cache_dtype",
        "strategy",
        "versions",
        "wall_time_s",
        "date",
        "layers",
    ):
        assert key in rec
    assert rec["kv_cache_dtype"] == "fp8_e4m3" and rec["strategy"] == "head" and rec["num_samples"] == 3
    assert rec["tokens"] == 120 and {"qkv", "torch", "transformers"} <= set(rec["versions"])
    assert len(rec["layers"]) == 3
    for row, r in zip(rec["layers"], cal.layers):
        assert row["k"]["scale"] == r.k_scale.tolist() and len(row["v"]["amax"]) == 2
        assert row["k"]["clip_rate"] == 0.0  # minmax
    # minmax: the observed absmax is what got stored (x 1/448)
    assert rec["layers"][0]["k"]["amax"] == rec["layers"][0]["k"]["observed_amax"]


def _llmcompressor_style(src: Path, dst: Path, strategy: str, scales: dict) -> Path:
    """A checkpoint as llm-compressor 0.14 writes it: scales in model.safetensors in the model dtype (bf16),
    shape (1,) per tensor or (kv_heads, 1, 1) per head, and its full quantization_config block."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = _weights(src)
    for (layer, w), s in scales.items():
        shape = (2, 1, 1) if strategy == "attn_head" else (1,)
        tensors[f"model.layers.{layer}.self_attn.{w}_scale"] = s.to(torch.bfloat16).reshape(shape)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {},
        "format": "dense",
        "global_compression_ratio": None,
        "ignore": [],
        "kv_cache_scheme": {
            "actorder": None,
            "block_structure": None,
            "dynamic": False,
            "group_size": None,
            "num_bits": 8,
            "observer": "static_minmax",
            "observer_kwargs": {},
            "scale_dtype": None,
            "strategy": strategy,
            "symmetric": True,
            "type": "float",
            "zp_dtype": None,
        },
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.19.0",
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "recipe.yaml").write_text("default_stage:\n  default_modifiers:\n    QuantizationModifier: {}\n")
    return dst


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_reads_llmcompressor_checkpoint(tiny_dir, tmp_path, strategy):
    from qkv import LLM

    g = torch.Generator().manual_seed(1)
    n = 2 if strategy == "attn_head" else 1
    scales = {(i, w): torch.rand(n, generator=g) * 0.01 + 0.001 for i in range(3) for w in "kv"}
    lc = _llmcompressor_style(tiny_dir(ARCH), tmp_path / "lc", strategy, scales)
    engine = LLM(str(lc), kv_cache_dtype="fp8", num_blocks=16).llm_engine
    for i in range(3):
        want_k = scales[i, "k"].to(torch.bfloat16).float().expand(2)
        assert torch.equal(engine.cache.layers[i].k_scale, want_k)
        assert torch.equal(engine.cache.layers[i].v_scale, scales[i, "v"].to(torch.bfloat16).float().expand(2))
    # calibrating such a checkpoint again replaces its scales (no duplicate tensor names for vLLM)
    cal = calibrate(str(lc), samples=Samples(_chunks(2)), kv_cache_dtype="fp8", strategy="tensor", progress=False)
    out = write_checkpoint(cal, tmp_path / "again")
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert index["model.layers.0.self_attn.k_scale"] == FP8_SCALES_FILE
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert not [k for k in fh.keys() if k.endswith("_scale")]  # noqa: SIM118 - a safetensors handle
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    )
    assert not (out / "recipe.yaml").exists()


@pytest.mark.parametrize("mode", ["copy", "symlink"])
def test_weights_copy_or_symlink(outputs, tiny_dir, tmp_path, mode):
    cal, _ = outputs["fp8", "tensor"]
    out = write_checkpoint(cal, tmp_path / mode, weights=mode)
    src = tiny_dir(ARCH) / "model.safetensors"
    assert (out / "model.safetensors").read_bytes() == src.read_bytes()
    assert (out / "model.safetensors").is_symlink() == (mode == "symlink")
    if mode == "copy":
        assert not os.path.samefile(out / "model.safetensors", src)
    with pytest.raises(ValueError, match="pass --overwrite"):
        write_checkpoint(cal, out)
    write_checkpoint(cal, out, overwrite=True)  # an earlier calibration output may be replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="only replaces an earlier `qkv calibrate` output"):
        write_checkpoint(cal, tmp_path / "other", overwrite=True)
    with pytest.raises(ValueError, match="is the model directory itself"):
        write_checkpoint(cal, tiny_dir(ARCH), overwrite=True)
