"""`qkv calibrate` from the command line: the happy path, data-free calibration, and every bad input
ending in one clear line."""

import json
from pathlib import Path

import pytest
import torch

from qkv.cli import main

TEXT = "Paged attention stores keys and values in fixed blocks of sixteen tokens. " * 60


@pytest.fixture()
def corpus(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)
    return f


def _run(capsys, *argv):
    rc = main(["calibrate", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _error(capsys, *argv) -> str:
    rc, out, err = _run(capsys, *argv, "--no-progress")
    lines = [ln for ln in err.splitlines() if ln.startswith("qkv: error:")]
    assert rc == 2 and len(lines) == 1, err
    return lines[0]


def test_cli_writes_a_calibrated_model(capsys, tiny_dir, corpus, tmp_path):
    out = tmp_path / "out"
    rc, stdout, _ = _run(
        capsys,
        tiny_dir("qwen3"),
        "--dataset",
        corpus,
        "--num-samples",
        3,
        "--seq-len",
        48,
        "--kv-cache-dtype",
        "int8",
        "--strategy",
        "head",
        "--observer",
        "percentile",
        "--percentile",
        99.9,
        "--seed",
        7,
        "-o",
        out,
        "--no-progress",
    )
    assert rc == 0
    assert "K amax" in stdout and "int8 / head / percentile (P99.9)" in stdout  # the summary table
    rec = json.loads((out / "calibration.json").read_text())
    assert rec["observer"] == "percentile" and rec["percentile"] == 99.9 and rec["seed"] == 7
    assert rec["dataset"]["source"] == "local" and rec["dataset"]["path"] == str(corpus.resolve())
    assert rec["tokens"] == 3 * 48 and rec["data_free"] is False and rec["wall_time_s"] > 0
    assert all(0 < row["k"]["clip_rate"] < 0.01 for row in rec["layers"])
    # the output serves: int8 cache with its own scales
    from qkv import LLM

    llm = LLM(str(out), kv_cache_dtype="int8", num_blocks=16)
    assert llm.generate("Paged attention")[0].outputs[0].token_ids
    # an existing output needs --overwrite
    assert "pass --overwrite" in _error(capsys, tiny_dir("qwen3"), "--dataset", corpus, "-o", out)


def test_data_free_calibration(capsys, tiny_dir, tmp_path):
    out = tmp_path / "free"
    rc, stdout, _ = _run(capsys, tiny_dir("gemma3"), "--num-samples", 2, "--seq-len", 24, "-o", out, "--no-progress")
    assert rc == 0 and "data-free" in stdout
    rec = json.loads((out / "calibration.json").read_text())
    assert rec["data_free"] is True and rec["dataset"]["source"] == "self-generated"
    assert rec["dataset"]["prompts"] and rec["tokens"] == 48


# -- bad input: one line each ------------------------------------------------------------------------------


def test_unknown_dataset_path(capsys, tiny_dir, tmp_path):
    msg = _error(capsys, tiny_dir("llama"), "--dataset", tmp_path / "nope.jsonl", "-o", tmp_path / "o")
    assert "unknown dataset" in msg and "no such file or folder" in msg


def test_unknown_hub_dataset(capsys, tiny_dir, tmp_path, monkeypatch):
    import datasets

    import qkv.calibrate.data as data

    def not_found(*a, **k):
        raise datasets.exceptions.DatasetNotFoundError("Dataset 'no-such-org/no-such-data' doesn't exist on the Hub")

    monkeypatch.setattr(data, "hub_offline_reason", lambda: None)  # pretend the hub answers
    monkeypatch.setattr(datasets, "load_dataset", not_found)
    msg = _error(capsys, tiny_dir("llama"), "--dataset", "no-such-org/no-such-data", "-o", tmp_path / "o")
    assert "unknown dataset 'no-such-org/no-such-data'" in msg and "not found on the Hugging Face hub" in msg


def test_offline_hub(capsys, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = _error(capsys, tiny_dir("llama"), "--dataset", "no-such-org/no-such-data", "-o", tmp_path / "o")
    assert "hub is offline (HF_HUB_OFFLINE=1 is set)" in msg and "pass a local" in msg


def test_missing_text_column_names_the_columns(capsys, tiny_dir, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"body": TEXT, "id": i}) for i in range(3)))
    msg = _error(capsys, tiny_dir("llama"), "--dataset", f, "--text-column", "text", "-o", tmp_path / "o")
    assert "--text-column 'text' is not in the dataset; available columns: body, id" in msg
    msg = _error(capsys, tiny_dir("llama"), "--dataset", f, "-o", tmp_path / "o")
    assert "pass --text-column (available columns: body, id)" in msg


@pytest.mark.parametrize("content", ["", "   \n\n  \n"])
def test_empty_dataset(capsys, tiny_dir, tmp_path, content):
    f = tmp_path / "empty.txt"
    f.write_text(content)
    assert "empty dataset" in _error(capsys, tiny_dir("llama"), "--dataset", f, "-o", tmp_path / "o")
    for name, body in (("e.json", "[]"), ("e.jsonl", "\n\n")):
        (tmp_path / name).write_text(body)
        assert "empty dataset" in _error(capsys, tiny_dir("llama"), "--dataset", tmp_path / name, "-o", tmp_path / "o")
    d = tmp_path / "emptydir"
    d.mkdir()
    assert "empty dataset" in _error(capsys, tiny_dir("llama"), "--dataset", d, "-o", tmp_path / "o")


def test_too_few_tokens_says_how_many(capsys, tiny_dir, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("The quick brown fox jumps over the lazy dog.")
    msg = _error(capsys, tiny_dir("llama"), "--dataset", f, "--num-samples", 8, "--seq-len", 64, "-o", tmp_path / "o")
    from transformers import AutoTokenizer

    n = len(
        AutoTokenizer.from_pretrained(str(tiny_dir("llama")))(
            "The quick brown fox jumps over the lazy dog.\n\n", add_special_tokens=False
        )["input_ids"]
    )
    assert f"too few tokens: the dataset has {n} tokens" in msg and "needs 512" in msg


def test_model_that_cannot_be_loaded(capsys, corpus, tmp_path):
    msg = _error(capsys, tmp_path / "no-model-here", "--dataset", corpus, "-o", tmp_path / "o")
    assert "no-model-here" in msg
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    msg = _error(capsys, broken, "--dataset", corpus, "-o", tmp_path / "o")
    assert "broken" in msg and ("cannot load model" in msg or "checkpoint" in msg)


def test_bad_flags(capsys, tiny_dir, corpus, tmp_path):
    m = tiny_dir("llama")
    assert "--percentile only applies" in _error(
        capsys, m, "--dataset", corpus, "--percentile", 99, "-o", tmp_path / "o"
    )
    assert "need --dataset" in _error(capsys, m, "--split", "validation", "-o", tmp_path / "o")
    assert "--percentile must be in (0, 100]" in _error(
        capsys, m, "--dataset", corpus, "--observer", "percentile", "--percentile", 120, "-o", tmp_path / "o"
    )
    assert "exceeds the model's max_position_embeddings" in _error(
        capsys, m, "--dataset", corpus, "--seq-len", 4096, "--num-samples", 1, "-o", tmp_path / "o"
    )
    assert not Path(tmp_path / "o").exists()


def test_cli_calibrates_clipping_ratios_for_a_4bit_cache(capsys, tiny_dir, corpus, tmp_path):
    """int4_per_token_head: one ratio per layer and side in the qkv section and file; the engine applies them
    when it runs that dtype (the rotation following the checkpoint), and another per-token mode does not."""
    from safetensors import safe_open

    from qkv import LLM

    out = tmp_path / "int4"
    flags = "--num-samples 3 --seq-len 48 --kv-cache-dtype int4_per_token_head --kv-rotation hadamard --no-progress"
    rc, stdout, _ = _run(capsys, tiny_dir("llama"), "--dataset", corpus, "-o", out, *flags.split())
    assert rc == 0 and "K MSE vs 1.0" in stdout and "int4_per_token_head / token_head / rotation hadamard" in stdout
    section = json.loads((out / "config.json").read_text())["qkv_kv_cache"]
    assert (section["kv_cache_dtype"], section["num_bits"], section["dynamic"]) == ("int4_per_token_head", 4, True)
    assert section["rotation"] == "hadamard" and "quantization_config" not in json.loads(
        (out / "config.json").read_text()
    )
    assert (section["int4_grid"], section["format_version"]) == ("signed", 4)
    with safe_open(str(out / "qkv_kv_scales.safetensors"), "pt") as f:
        names = sorted(f.keys())
        clips = {n: float(f.get_tensor(n)) for n in names}
        assert f.metadata()["int4_grid"] == "signed"
    assert names == sorted(f"model.layers.{i}.self_attn.{w}_clip" for i in range(3) for w in "kv")
    rec = json.loads((out / "calibration.json").read_text())
    assert rec["layers"] == [] and [c["layer"] for c in rec["clips"]] == [0, 1, 2]
    for c in rec["clips"]:  # never worse than no clipping on the calibration tokens
        for side in "kv":
            assert c[side]["mse"] <= c[side]["mse_unclipped"]
            assert c[side]["clip"] == clips[f"model.layers.{c['layer']}.self_attn.{side}_clip"]
    engine = LLM(str(out), kv_cache_dtype="int4_per_token_head", num_blocks=16).llm_engine
    for i, layer in enumerate(engine.cache.layers):
        assert (layer.k_clip, layer.v_clip) == (
            clips[f"model.layers.{i}.self_attn.k_clip"],
            clips[f"model.layers.{i}.self_attn.v_clip"],
        )
        assert layer.rotate
    other = LLM(str(out), kv_cache_dtype="int8_per_token_head", num_blocks=16).llm_engine
    assert all((layer.k_clip, layer.v_clip, layer.rotate) == (1.0, 1.0, False) for layer in other.cache.layers)
    with pytest.raises(ValueError, match="holds ratios for int4_per_token_head; --kv-cache-dtype k8v4_per_token_head"):
        LLM(str(tiny_dir("llama")), kv_cache_dtype="k8v4_per_token_head", kv_scales=str(out), num_blocks=16)
    with pytest.raises(ValueError, match="holds no k_scale/v_scale tensors"):
        LLM(str(tiny_dir("llama")), kv_cache_dtype="fp8", kv_scales=str(out), num_blocks=16)
    # ratios from before the signed grid (no int4_grid in the section) are refused, not applied to another grid
    config = json.loads((out / "config.json").read_text())
    del config["qkv_kv_cache"]["int4_grid"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"int4_per_token_head were chosen for qkv's earlier symmetric int4 grid"):
        LLM(str(out), kv_cache_dtype="int4_per_token_head", num_blocks=16)
    assert "--strategy and --observer do not apply" in _error(
        capsys,
        tiny_dir("llama"),
        "--dataset",
        corpus,
        "--kv-cache-dtype",
        "int4_per_token_head",
        "--strategy",
        "head",
        "-o",
        tmp_path / "x",
    )


def test_cli_key_basis_writes_means_and_smoothing_the_engine_applies(capsys, tiny_dir, corpus, tmp_path):
    """--key-basis: every layer's k_mean (K's mean over the samples) and k_smooth ([Hkv, D], geometric mean 1 per
    head) beside the ratios; the engine installs them on its int4 layers; an 8-bit dtype refuses the flag."""
    from safetensors import safe_open

    from qkv import LLM

    out = tmp_path / "basis"
    flags = "--num-samples 3 --seq-len 48 --kv-cache-dtype int4_per_token_head --key-basis --no-progress"
    rc, stdout, _ = _run(capsys, tiny_dir("llama"), "--dataset", corpus, "-o", out, *flags.split())
    assert rc == 0 and "K MSE vs 1.0" in stdout
    with safe_open(str(out / "qkv_kv_scales.safetensors"), "pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    want = [f"model.layers.{i}.self_attn.{w}" for i in range(3) for w in ("k_clip", "k_mean", "k_smooth", "v_clip")]
    assert names == sorted(want)
    rec = json.loads((out / "calibration.json").read_text())
    assert [b["layer"] for b in rec["key_basis"]] == [0, 1, 2]
    assert rec["scale_convention"].endswith("on centred, smoothed K (k_mean, k_smooth)")
    assert rec["observer_params"]["key_basis"].startswith("K centred and smoothed against Q")
    engine = LLM(str(out), kv_cache_dtype="int4_per_token_head", num_blocks=16).llm_engine
    for i, layer in enumerate(engine.cache.layers):
        smooth = tensors[f"model.layers.{i}.self_attn.k_smooth"]
        assert smooth.shape == (2, 16) and torch.allclose(smooth.log().mean(-1), torch.zeros(2), atol=1e-5)
        assert torch.equal(layer.key_basis.mean, tensors[f"model.layers.{i}.self_attn.k_mean"])
        assert torch.equal(layer.key_basis.smooth, smooth)
        assert rec["key_basis"][i]["k_smooth_max"] == float(smooth.max())
    assert engine.cache.dtype_summary() == "int4_per_token_head+key-basis x3"
    other = LLM(str(out), kv_cache_dtype="int8_per_token_head", num_blocks=16).llm_engine
    assert all(layer.key_basis is None for layer in other.cache.layers)
    err = _error(capsys, tiny_dir("llama"), "--dataset", corpus, "--kv-cache-dtype", "fp8", "--key-basis", "-o", out)
    assert "--key-basis applies to the 4-bit per-token modes, not fp8" in err
