"""Rotation, per-channel scales, auto-skip, export and --search through the engine, on tiny models.

The kernels themselves are tested in tests/kernels/test_rotation_channel.py; here the
whole path runs: calibrate -> checkpoint -> engine (scales and rotation picked
up from the checkpoint metadata) -> logits, plus the refusals a user hits.
"""

import dataclasses
import json
import math

import pytest
import torch
from safetensors import safe_open

from qkv import LLM
from qkv.calibrate.autoskip import select_skip_layers
from qkv.calibrate.checkpoint import write_checkpoint, write_scales_file
from qkv.calibrate.data import Samples
from qkv.calibrate.export import export_vllm
from qkv.calibrate.run import calibrate, load_engine
from qkv.cli import main
from qkv.scoring import prefill_logits

TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed "
    "blocks of sixteen tokens. An eight bit cache holds twice the tokens in the same memory. "
) * 40


def _chunks(n=3, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 384, (length - 1,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return str(tiny_dir("llama"))  # 3 layers, 2 kv heads, head_dim 16


@pytest.fixture(scope="module")
def ckpts(llama, tmp_path_factory):
    base = tmp_path_factory.mktemp("rotcal")
    out = {}
    for dt, strategy, rot in [
        ("fp8", "channel", "hadamard"),
        ("int8", "head", "hadamard"),
        ("fp8", "channel", "none"),
        ("int8", "channel", "none"),
        ("fp8", "tensor", "none"),
        ("fp8", "head", "none"),
    ]:
        cal = calibrate(
            llama, samples=Samples(_chunks()), kv_cache_dtype=dt, strategy=strategy, progress=False, rotation=rot
        )
        out[dt, strategy, rot] = (cal, write_checkpoint(cal, base / f"{dt}-{strategy}-{rot}"))
    return out


def _logits(llm, ids):
    return prefill_logits(llm.llm_engine, ids)


def test_rotation_without_quantization_is_the_plain_model(tiny_dir):
    """fp32 model, fp32 cache: rotating K/V changes nothing beyond rounding (1e-5), greedy tokens included."""
    for arch in ("llama", "gemma3"):  # gemma3: sliding-window layers, head_dim 32
        model = str(tiny_dir(arch))
        plain = LLM(model, dtype="float32", kv_cache_dtype="float32", num_blocks=40)
        rot = LLM(model, dtype="float32", kv_cache_dtype="float32", num_blocks=40, kv_rotation="hadamard")
        assert all(s.rotation == "hadamard" for s in rot.llm_engine.layer_specs)
        ids = _chunks(1, 60, seed=3)[0]  # 60 tokens: past the tiny gemma's 24-token window
        a, b = _logits(plain, ids), _logits(rot, ids)
        assert (a - b).abs().max().item() < 1e-5 * max(1.0, a.abs().max().item())
        from qkv import SamplingParams

        p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [ids[:20], ids[:7]]
        assert [o.outputs[0].token_ids for o in plain.generate(prompts, p)] == [
            o.outputs[0].token_ids for o in rot.generate(prompts, p)
        ]


def test_checkpoint_metadata_for_extensions(ckpts):
    cal, out = ckpts["fp8", "channel", "hadamard"]
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg or cfg["quantization_config"].get("kv_cache_scheme") is None
    sec = cfg["qkv_kv_cache"]
    assert (sec["type"], sec["strategy"], sec["rotation"], sec["vllm_readable"], sec["format_version"]) == (
        "float",
        "channel",
        "hadamard",
        False,
        4,  # 3: the section names its kv_cache_dtype; 4: a 4-bit mode's section names its int4_grid
    )
    with safe_open(str(out / "qkv_kv_scales.safetensors"), framework="pt") as fh:
        assert fh.metadata()["rotation"] == "hadamard" and fh.metadata()["strategy"] == "channel"
        k0 = fh.get_tensor("model.layers.0.self_attn.k_scale")
    assert k0.shape == (2, 16) and torch.equal(k0, cal.layers[0].k_scale)
    # a plain fp8 checkpoint stays compressed-tensors, without a qkv section
    cfg = json.loads((ckpts["fp8", "tensor", "none"][1] / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor" and "qkv_kv_cache" not in cfg


@pytest.mark.parametrize(
    "key", [("fp8", "channel", "hadamard"), ("int8", "head", "hadamard"), ("int8", "channel", "none")]
)
def test_engine_follows_the_checkpoint(ckpts, key):
    cal, out = ckpts[key]
    name = {"fp8": "fp8", "int8": "int8"}[key[0]]
    eng = LLM(str(out), kv_cache_dtype=name, num_blocks=20).llm_engine
    rot = None if key[2] == "none" else key[2]
    assert [s.rotation for s in eng.layer_specs] == [rot] * 3
    for layer, r in zip(eng.cache.layers, cal.layers):
        want = r.k_scale if key[1] == "channel" else r.k_scale.reshape(-1).expand(2)
        assert torch.equal(layer.k_scale, want)


def test_skipped_layers_stay_plain_under_rotation(ckpts):
    out = str(ckpts["int8", "head", "hadamard"][1])
    eng = LLM(out, kv_cache_dtype="int8", num_blocks=20, kv_cache_dtype_skip_layers=[1]).llm_engine
    assert [(s.dtype.name, s.rotation) for s in eng.layer_specs] == [
        ("int8", "hadamard"),
        ("float32", None),
        ("int8", "hadamard"),
    ]
    assert eng.cache.dtype_summary() == "int8+hadamard x2 + float32 x1"
    ids = _chunks(1, 30, seed=4)[0]
    full = prefill_logits(LLM(out, kv_cache_dtype="int8", num_blocks=20).llm_engine, ids)
    part = prefill_logits(eng, ids)
    assert bool(torch.isfinite(part).all()) and not torch.equal(full, part)


def test_rotation_flag_must_match_the_scales(ckpts, tmp_path):
    rotated = str(ckpts["int8", "head", "hadamard"][1])
    plain = str(ckpts["fp8", "channel", "none"][1])
    with pytest.raises(ValueError, match="calibrated with --kv-rotation hadamard .* --kv-rotation none"):
        LLM(rotated, kv_cache_dtype="int8", num_blocks=20, kv_rotation="none")
    with pytest.raises(ValueError, match="calibrated with --kv-rotation none .* --kv-rotation hadamard"):
        LLM(plain, kv_cache_dtype="fp8", num_blocks=20, kv_rotation="hadamard")
    # a bare channel-scales file carries its rotation flag too
    f = write_scales_file(ckpts["fp8", "channel", "hadamard"][0], tmp_path / "ch.safetensors")
    with pytest.raises(ValueError, match="calibrated with --kv-rotation hadamard"):
        LLM(plain, kv_cache_dtype="fp8", kv_scales=str(f), num_blocks=20, kv_rotation="none")
    eng = LLM(plain, kv_cache_dtype="fp8", kv_scales=str(f), num_blocks=20).llm_engine  # auto follows the file
    assert eng.layer_specs[0].rotation == "hadamard" and eng.cache.layers[0].k_scale.shape == (2, 16)
    # channel scales whose shape does not fit the model are refused
    cfg = json.loads((ckpts["fp8", "channel", "none"][1] / "config.json").read_text())
    assert cfg["qkv_kv_cache"]["strategy"] == "channel"


def test_rotation_needs_a_power_of_two_head_dim(tiny_dir, capsys, tmp_path):
    model = str(tiny_dir("llama_hd48"))
    with pytest.raises(ValueError, match="power-of-two head_dim.*48"):
        LLM(model, kv_cache_dtype="fp8", num_blocks=20, kv_rotation="hadamard")
    assert (
        main(
            [
                "calibrate",
                model,
                "--kv-cache-dtype",
                "int8",
                "--kv-rotation",
                "hadamard",
                "--num-samples",
                "1",
                "--seq-len",
                "16",
                "--no-progress",
                "-o",
                str(tmp_path / "never-written"),
            ]
        )
        == 2
    )
    assert "power-of-two head_dim" in capsys.readouterr().err and not (tmp_path / "never-written").exists()
    LLM(model, kv_cache_dtype="fp8", num_blocks=20)  # without rotation the model runs


def test_triton_backend_matches_torch_for_rotated_channel_int8(ckpts):
    out = str(ckpts["int8", "channel", "none"][1])
    ids = _chunks(1, 40, seed=5)[0]
    ref = _logits(LLM(out, kv_cache_dtype="int8", num_blocks=20, attention_backend="torch"), ids)
    tri = _logits(LLM(out, kv_cache_dtype="int8", num_blocks=20, attention_backend="triton"), ids)
    assert (ref - tri).abs().max().item() < 1e-3 * ref.abs().max().item()
    out = str(ckpts["fp8", "channel", "hadamard"][1])
    ref = _logits(LLM(out, kv_cache_dtype="fp8", num_blocks=20, attention_backend="torch"), ids)
    tri = _logits(LLM(out, kv_cache_dtype="fp8", num_blocks=20, attention_backend="triton"), ids)
    assert (ref - tri).abs().max().item() < 2e-2 * ref.abs().max().item()  # bf16 model


def test_prefix_caching_with_rotation_reuses_blocks_and_matches(ckpts):
    from qkv import SamplingParams

    out = str(ckpts["int8", "head", "hadamard"][1])
    prefix = _chunks(1, 48, seed=6)[0]
    prompts = [prefix + [5, 6, 7], prefix + [9, 10]]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cached = LLM(out, kv_cache_dtype="int8", num_blocks=40, batch_invariant=True)
    cold = LLM(out, kv_cache_dtype="int8", num_blocks=40, enable_prefix_caching=False, batch_invariant=True)
    a = [cached.generate([q], p)[0].outputs[0].token_ids for q in prompts]
    assert cached.llm_engine.kv_manager.prefix_hits >= 48  # the second prompt reused 3 full blocks
    b = [cold.generate([q], p)[0].outputs[0].token_ids for q in prompts]
    assert a == b


def test_export_vllm(ckpts, tmp_path):
    with pytest.raises(ValueError, match="rotated K/V.*vLLM cannot"):
        export_vllm(ckpts["fp8", "channel", "hadamard"][1], tmp_path / "a")
    with pytest.raises(ValueError, match="no static int8 KV cache"):
        export_vllm(ckpts["int8", "channel", "none"][1], tmp_path / "b")
    out, notes = export_vllm(ckpts["fp8", "channel", "none"][1], tmp_path / "c")
    assert any("reduced per-channel scales to per-head" in n for n in notes)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    head_cal = ckpts["fp8", "head", "none"][0]  # per-head minmax of the same samples
    with safe_open(str(out / "kv_cache_scales.safetensors"), framework="pt") as fh:
        for r in head_cal.layers:
            assert torch.equal(fh.get_tensor(f"model.layers.{r.layer}.self_attn.k_scale"), r.k_scale)
            assert torch.equal(fh.get_tensor(f"model.layers.{r.layer}.self_attn.v_scale"), r.v_scale)


def test_export_vllm_cli_prints_the_skip_flags(ckpts, tmp_path, capsys):
    cal, _ = ckpts["fp8", "tensor", "none"]
    cal.skip_layers = [2]
    src = write_checkpoint(cal, tmp_path / "skip2")
    cal.skip_layers = None
    assert main(["export-vllm", str(src), "-o", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 2`" in printed
    assert json.loads((tmp_path / "out" / "config.json").read_text())["qkv_kv_cache"]["skip_layers"] == [2]
    assert main(["export-vllm", str(ckpts["int8", "head", "hadamard"][1]), "-o", str(tmp_path / "x")]) == 2


def _ppl_delta(engine_q, engine_b, windows):
    def nll(e):
        tot = 0.0
        for w in windows:
            lq = torch.log_softmax(prefill_logits(e, w)[:-1].float(), -1)
            tot += float(-lq.gather(1, torch.tensor(w[1:])[:, None]).double().sum())
        return tot

    n = sum(len(w) - 1 for w in windows)
    return 100 * (math.exp((nll(engine_q) - nll(engine_b)) / n) - 1)


def test_auto_skip_selection(llama, tmp_path):
    cal = calibrate(llama, samples=Samples(_chunks(2, 32)), kv_cache_dtype="int8", strategy="tensor", progress=False)
    for r in cal.layers:  # coarse scales: quantization visibly hurts every layer
        r.k_scale, r.v_scale = r.k_scale * 8, r.v_scale * 8
    held = _chunks(2, 40, seed=9)
    engine = load_engine(llama, seq_len=40).llm_engine
    rec = select_skip_layers(engine, cal, held, max_ppl_delta=1e9, progress=False)
    assert rec["skip_layers"] == [] and len(rec["search"]) == 1
    assert rec["ranking"] == sorted(range(3), key=lambda i: -rec["layers"][i]["kl_mean"])
    # k = 0 (every layer quantized) is what a fresh engine with the same scales measures
    cal.skip_layers = None
    out = write_checkpoint(cal, tmp_path / "coarse")
    fresh = LLM(str(out), kv_cache_dtype="int8", num_blocks=8).llm_engine
    assert rec["search"][0]["ppl_delta_pct"] == pytest.approx(_ppl_delta(fresh, engine, held), abs=1e-9)
    # two windows of one length: the resamples are each window alone or both, so the interval's ends are the
    # two windows' own changes
    per_window = sorted(_ppl_delta(fresh, engine, [w]) for w in held)
    assert rec["search"][0]["ppl_delta_pct_ci95"] == pytest.approx(per_window, abs=1e-9)
    assert per_window[0] < per_window[1] and rec["stop"] == "upper"
    # an impossible budget keeps every layer in BF16, trying the most sensitive first
    rec = select_skip_layers(engine, cal, held, max_ppl_delta=-1e9, progress=False)
    assert rec["skip_layers"] == [0, 1, 2] and [s["skip_layers"] for s in rec["search"]] == [
        sorted(rec["ranking"][:k]) for k in range(4)
    ]
    assert rec["search"][-1]["ppl_delta_pct"] == 0.0
    assert rec["search"][-1]["ppl_delta_pct_ci95"] == [0.0, 0.0]
    # a budget between two measured points picks the first k that meets it: by the point estimate under
    # stop="point", by the upper end of the interval by default
    for stop, at in (("point", lambda s: s["ppl_delta_pct"]), ("upper", lambda s: s["ppl_delta_pct_ci95"][1])):
        values = [at(s) for s in rec["search"]]
        k = next(i for i, v in enumerate(values) if v <= values[1] + 1e-12)
        rec2 = select_skip_layers(engine, cal, held, max_ppl_delta=values[1] + 1e-12, progress=False, stop=stop)
        assert rec2["skip_layers"] == sorted(rec["ranking"][:k]) and rec2["stop"] == stop
    with pytest.raises(ValueError, match="--auto-skip-stop"):
        select_skip_layers(engine, cal, held, max_ppl_delta=1.0, progress=False, stop="mean")
    assert not any(s.dtype.quantized for s in engine.layer_specs)  # left unquantized


def test_auto_skip_keeps_layers_in_8_bits(llama, tmp_path, capsys):
    """--kv-cache-dtype-skip-dtype int8_per_token_head: a 4-bit cache's kept layers hold per-token int8, in the
    search's passes as in the served checkpoint; the per-layer sensitivities stay measured against BF16."""
    cal = calibrate(llama, samples=Samples(_chunks(2, 32)), kv_cache_dtype="int4_per_token_head", progress=False)
    held = _chunks(2, 40, seed=9)
    engine = load_engine(llama, seq_len=40).llm_engine
    plain = select_skip_layers(engine, cal, held, max_ppl_delta=-1e9, progress=False)
    rec = select_skip_layers(
        engine, cal, held, max_ppl_delta=-1e9, progress=False, skip_dtype="int8_per_token_head"
    )  # an impossible budget: every point of the search is measured, the last one too
    assert rec["skip_dtype"] == "int8_per_token_head" and plain["skip_dtype"] == "auto"
    assert rec["layers"] == plain["layers"] and rec["ranking"] == plain["ranking"]
    assert rec["skip_layers"] == [0, 1, 2] and len(rec["search"]) == 4
    assert rec["search"][0] == plain["search"][0]  # nothing kept: the same cache
    every8 = LLM(llama, kv_cache_dtype="int8_per_token_head", num_blocks=8).llm_engine
    assert rec["search"][3]["ppl_delta_pct"] == pytest.approx(_ppl_delta(every8, engine, held), abs=1e-9)
    assert rec["search"][3]["ppl_delta_pct"] != 0.0 and plain["search"][3]["ppl_delta_pct"] == 0.0
    # the checkpoint keeps the most sensitive layer in int8 and the rest in int4: served as the search measured it
    top = rec["ranking"][0]
    cal.skip_layers, cal.skip_dtype = [top], "int8_per_token_head"
    out = write_checkpoint(cal, tmp_path / "int4-skip8")
    assert json.loads((out / "config.json").read_text())["qkv_kv_cache"]["skip_dtype"] == "int8_per_token_head"
    served = LLM(str(out), kv_cache_dtype="int4_per_token_head", num_blocks=8).llm_engine
    names = [s.dtype.name for s in served.layer_specs]
    assert names == ["int8_per_token_head" if i == top else "int4_per_token_head" for i in range(3)]
    assert _ppl_delta(served, engine, held) == pytest.approx(rec["search"][1]["ppl_delta_pct"], abs=1e-9)
    # per token and layer, 2 kv heads of 16: int4 2 x 2 x 8 bytes, int8 2 x 2 x 16, each with 2 x 2 fp32 scales
    assert served.kv_bytes_per_token == 2 * (32 + 16) + (64 + 16)
    # the 4-bit clipping ratios go to the 4-bit layers only
    cal.clips = [dataclasses.replace(c, k_clip=0.5, v_clip=0.75) for c in cal.clips or []]
    clipped = LLM(str(write_checkpoint(cal, tmp_path / "clipped")), kv_cache_dtype="int4_per_token_head", num_blocks=8)
    ratios = [(c.k_clip, c.v_clip) for c in clipped.llm_engine.cache.layers]
    assert ratios == [(1.0, 1.0) if i == top else (0.5, 0.75) for i in range(3)]
    bf16 = LLM(str(out), kv_cache_dtype="int4_per_token_head", kv_cache_dtype_skip_dtype="auto", num_blocks=8)
    assert not bf16.llm_engine.layer_specs[top].dtype.quantized  # an explicit flag wins: the model dtype
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_dtype: --kv-cache-dtype-skip-dtype must be one of"):
        LLM(llama, kv_cache_dtype="int4_per_token_head", kv_cache_dtype_skip_dtype="int8", num_blocks=8)
    args = ["calibrate", llama, "--kv-cache-dtype", "int4_per_token_head", "-o", str(tmp_path / "x")]
    assert main([*args, "--kv-cache-dtype-skip-dtype", "int8_per_token_head"]) == 2
    assert "--kv-cache-dtype-skip-dtype: auto-skip's flag; add --auto-skip" in capsys.readouterr().err


def test_auto_skip_cli_writes_and_engine_applies(llama, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "auto"
    assert (
        main(
            [
                "calibrate",
                llama,
                "--dataset",
                str(text),
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "--kv-cache-dtype",
                "fp8",
                "--auto-skip",
                "--max-ppl-delta=-1000%",
                "--heldout-samples",
                "2",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        == 2
    )  # a negative budget is bad input
    args = ["calibrate", llama, "--dataset", str(text), "--num-samples", "2", "--seq-len", "32", "-o", str(out)]
    assert main([*args, "--auto-skip-stop", "point"]) == 2  # auto-skip's flag without --auto-skip
    assert "--auto-skip-stop: auto-skip's flag; add --auto-skip" in capsys.readouterr().err
    assert (
        main(
            [
                "calibrate",
                llama,
                "--dataset",
                str(text),
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "--kv-cache-dtype",
                "int8",
                "--auto-skip",
                "--max-ppl-delta",
                "0%",
                "--heldout-samples",
                "2",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    rec = json.loads((out / "calibration.json").read_text())["auto_skip"]
    cfg = json.loads((out / "config.json").read_text())["qkv_kv_cache"]
    assert cfg["skip_layers"] == rec["skip_layers"] and rec["ppl_delta_pct_ci95"][1] <= 0.0
    assert rec["stop"] == "upper" and rec["search"][-1]["ppl_delta_pct_ci95"] == rec["ppl_delta_pct_ci95"]
    assert f"keep layers {rec['skip_layers'] or 'none'} in BF16" in printed
    assert (out / "sensitivity.png").stat().st_size > 10_000
    eng = LLM(str(out), kv_cache_dtype="int8", num_blocks=8).llm_engine
    assert [i for i, s in enumerate(eng.layer_specs) if not s.dtype.quantized] == rec["skip_layers"]
    eng = LLM(str(out), kv_cache_dtype="int8", num_blocks=8, kv_cache_dtype_skip_layers=[]).llm_engine
    assert all(s.dtype.name == "int8" for s in eng.layer_specs)  # an explicit flag wins


def test_eval_search_recommends_the_smallest_within_budget(llama, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    rep = tmp_path / "search"
    args = [
        "eval",
        llama,
        "--search",
        "--dataset",
        str(text),
        "--calib-dataset",
        str(text),
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "32",
        "--num-windows",
        "2",
        "--window",
        "48",
        "--ttft-lengths",
        "none",
        "--bootstrap",
        "50",
        "--report",
        str(rep),
    ]
    assert main(args + ["--max-ppl-delta", "1000%"]) == 0
    rec = json.loads((rep / "search.json").read_text())
    labels = [r["config"] for r in rec["ranked"]]
    assert len(labels) == 1 + 12 + 8 and "fp8:fp8-channel-hadamard" in labels  # 4 per-token modes x 2 rotations
    assert "int8_per_token_head+rot=hadamard" in labels and "int4_per_token_head+rot=hadamard" in labels
    static = [
        r for r in rec["ranked"] if r["kv_bytes_per_token"] == min(x["kv_bytes_per_token"] for x in rec["ranked"])
    ]
    assert rec["recommended"]["config"] == min(static, key=lambda r: r["kl_mean"])["config"]
    assert "Recommended" in (rep / "search.md").read_text() and "recommended:" in capsys.readouterr().out
    assert (
        main(
            args
            + [
                "--max-ppl-delta",
                "1000%",
                "--search-dtypes",
                "int8",
                "--search-strategies",
                "tensor",
                "--search-rotations",
                "hadamard",
                "--no-search-dynamic",
            ]
        )
        == 0
    )
    rec = json.loads((rep / "search.json").read_text())
    # the same bytes per token: the order is by mean KL, which this random model decides
    assert sorted(r["config"] for r in rec["ranked"]) == ["fp8", "int8:int8-tensor-hadamard"]
    assert main(args + ["--search-dtypes", "int4"]) == 2  # no budget and a bad grid: clear errors


def test_search_recommends_nothing_over_budget():
    """No configuration within the budget: no recommendation, so `qkv eval --search` exits 1 (run_search)."""
    from qkv.eval.search import recommend, search_markdown

    acc = {
        "bf16": {"ppl_delta_pct": 0.0},
        "fp8": {"ppl_delta_pct": 0.5, "ppl_delta_pct_ci95": [0.4, 0.6], "kl_mean": 0.01, "top1_agreement": 0.9},
    }
    report = {
        "baseline": "bf16",
        "accuracy": acc,
        "configs": [{"label": k, "spec": k} for k in acc],
        "memory": {"bf16": {"kv_bytes_per_token": 4}, "fp8": {"kv_bytes_per_token": 2}},
    }
    rec = recommend(report, 0.1)
    assert rec["recommended"] is None and [r["within_budget"] for r in rec["ranked"]] == [False]
    assert "No configuration is within the budget" in search_markdown(
        rec, "m", {"samples": 1, "seq_len": 8, "dataset": "t.txt"}
    )
    assert recommend(report, 0.5)["recommended"]["config"] == "fp8"


def test_saturation_counts(llama, tmp_path):
    from qkv.eval.saturation import count_saturation
    from qkv.scales import read_kv_scales

    windows = _chunks(2, 40, seed=11)
    cal = calibrate(llama, samples=Samples(windows), kv_cache_dtype="int8", strategy="channel", progress=False)
    exact = read_kv_scales(write_scales_file(cal, tmp_path / "exact.safetensors"))  # minmax on these very windows
    for r in cal.layers:
        r.k_scale = r.k_scale / 4
    tight = read_kv_scales(write_scales_file(cal, tmp_path / "tight.safetensors"))
    engine = load_engine(llama, seq_len=40).llm_engine
    got = count_saturation(engine, windows, {"exact": exact, "tight": tight}, split_at=20)
    assert got["values_per_tensor"] == 2 * 3 * 40 * 2 * 16  # windows x layers x tokens x kv heads x head_dim
    assert got["sources"]["exact"] == {"k": 0, "v": 0, "k_at_or_past_split": 0, "v_at_or_past_split": 0}
    t = got["sources"]["tight"]
    assert t["v"] == 0 and t["k"] > 0 and 0 < t["k_at_or_past_split"] < t["k"]
