"""qkv eval on tiny models: metrics against hand-computed values, the gate, --compare, bad input, reports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from support.scales import observe_amax, write_scales_dir

from qkv import LLM
from qkv.cli import main
from qkv.data_files import WIKITEXT_TEST
from qkv.eval import accuracy, data
from qkv.eval.configs import parse_configs
from qkv.eval.gate import compare
from qkv.metrics import token_metrics, token_nll
from qkv.scoring import prefill_logits

TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in fixed "
    "blocks of sixteen tokens. An eight bit cache holds twice the tokens in the same memory. "
) * 40
FAST = ["--ttft-lengths", "none", "--bootstrap", "200"]


# -- helpers shared with the other eval tests ------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_dir):
    return str(tiny_dir("llama"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "text.txt"
    p.write_text(TEXT.replace(". ", ".\r\n"))  # CRLF must be normalised
    return p


@pytest.fixture(scope="module")
def scales(llama, text_file, tmp_path_factory):
    """Calibrated (amax) scales for the tiny llama and a broken copy with scales / 64."""
    engine = LLM(llama, dtype="bfloat16", kv_cache_memory="16MiB").llm_engine
    windows = data.make_windows(engine.tokenizer, data.load_text(str(text_file)).text, 4, 64)
    k, v = observe_amax(engine, windows)
    base = tmp_path_factory.mktemp("scales")
    return write_scales_dir(base / "calib", k, v), write_scales_dir(base / "broken", k, v, divide=64.0)


def run(args, capsys=None) -> int:
    return main(["eval", *args])


# -- metrics -------------------------------------------------------------------------------------------
def test_token_metrics_by_hand():
    base = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    q = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 1.0, 0.0]])
    nll, kl, agree = token_metrics(base, q, torch.tensor([0, 2]))
    assert nll[0] == pytest.approx(-math.log(0.5))
    assert nll[1] == pytest.approx(-math.log(1 / (2 + math.e)))
    assert kl[0] == pytest.approx(1 / 3 * math.log((1 / 3) / 0.5) + 2 / 3 * math.log((1 / 3) / 0.25))
    p = np.exp([2.0, 0, 0]) / np.exp([2.0, 0, 0]).sum()
    qq = np.exp([0.0, 1, 0]) / np.exp([0.0, 1, 0]).sum()
    assert kl[1] == pytest.approx(float((p * np.log(p / qq)).sum()))
    assert agree.tolist() == [True, False]
    assert torch.equal(token_nll(q, torch.tensor([0, 2])), nll)  # auto-skip's NLL is the same numbers


def test_ppl_kl_top1_on_tiny_model_match_hand_computation(llama, text_file):
    """summarize() over engines equals exp(mean CE) and mean KL computed here from the raw logits."""
    from transformers import AutoModelForCausalLM

    engines = {
        "bf16": LLM(llama, dtype="float32", kv_cache_memory="16MiB").llm_engine,
        "fp8": LLM(llama, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="16MiB").llm_engine,
    }
    windows = data.make_windows(engines["bf16"].tokenizer, data.load_text(str(text_file)).text, 3, 48)
    got = accuracy.summarize(accuracy.score_windows(engines, windows, "bf16"), "bf16", 100)
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    ce_hf, ce_b, ce_f, kls, agree = [], [], [], [], []
    for ids in windows:
        t = torch.tensor(ids)
        with torch.no_grad():
            ref = hf(t[None]).logits[0, :-1]
        lb = prefill_logits(engines["bf16"], ids)[:-1]
        lf = prefill_logits(engines["fp8"], ids)[:-1]
        ce_hf += torch.nn.functional.cross_entropy(ref, t[1:], reduction="none").tolist()
        ce_b += torch.nn.functional.cross_entropy(lb, t[1:], reduction="none").tolist()
        ce_f += torch.nn.functional.cross_entropy(lf, t[1:], reduction="none").tolist()
        p, q = lb.softmax(-1).double().numpy(), lf.softmax(-1).double().numpy()
        kls += (p * (np.log(p) - np.log(q))).sum(-1).tolist()
        agree += (lb.argmax(-1) == lf.argmax(-1)).tolist()
    assert got["bf16"]["ppl"] == pytest.approx(math.exp(np.mean(ce_hf)), rel=1e-4)  # engine == transformers
    assert got["bf16"]["ppl"] == pytest.approx(math.exp(np.mean(ce_b)), rel=1e-9)
    assert got["fp8"]["ppl"] == pytest.approx(math.exp(np.mean(ce_f)), rel=1e-9)
    assert got["fp8"]["ppl_delta_pct"] == pytest.approx(100 * (math.exp(np.mean(ce_f) - np.mean(ce_b)) - 1), rel=1e-6)
    assert got["fp8"]["kl_mean"] == pytest.approx(np.mean(kls), rel=1e-3, abs=1e-7)
    assert got["fp8"]["kl_p99"] == pytest.approx(np.percentile(kls, 99), rel=1e-3, abs=1e-7)
    assert got["fp8"]["top1_agreement"] == pytest.approx(np.mean(agree))
    assert got["bf16"]["kl_mean"] == 0 and got["bf16"]["top1_agreement"] == 1
    lo, hi = got["fp8"]["ppl_delta_pct_ci95"]
    assert lo <= got["fp8"]["ppl_delta_pct"] <= hi


def test_paired_bootstrap_is_paired():
    """A uniform +0.1 nats/token shift gives exactly exp(0.1) in every resample, however different the windows."""
    num, den = np.array([10.0, 50.0, 90.0]), np.array([10.0, 10.0, 10.0])
    d = accuracy.paired_bootstrap(num + 0.1 * den, den, num, den, 500, 0)
    assert np.allclose(d, 100 * (math.exp(0.1) - 1))


# -- the CLI: report, gate, compare ----------------------------------------------------------------
def test_gate_fails_on_scales_divided_by_64(llama, text_file, scales, tmp_path, capsys):
    calib, broken = scales
    out = tmp_path / "rep"
    code = run(
        [
            llama,
            "--configs",
            f"bf16,fp8:{calib},fp8:{broken},int8_per_token_head",
            "--dataset",
            str(text_file),
            "--num-windows",
            "4",
            "--window",
            "64",
            "--report",
            str(out),
            "--max-kl",
            "0.01",
            "--ttft-lengths",
            "16",
            "--repeats",
            "1",
            "--decode-tokens",
            "3",
            "--decode-prompt-len",
            "16",
            "--decode-batches",
            "1,2",
            "--bootstrap",
            "200",
            "--cpu-matmul-dtype",
            "float32",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    r = json.loads((out / "report.json").read_text())
    v = {k: x["verdict"] for k, x in r["verdicts"].items()}
    assert v == {"bf16": "BASELINE", "fp8:calib": "PASS", "fp8:broken": "FAIL", "int8_per_token_head": "PASS"}
    assert "FAIL fp8:broken" in printed
    assert r["accuracy"]["fp8:broken"]["kl_mean"] > 10 * r["accuracy"]["fp8:calib"]["kl_mean"]
    md = (out / "report.md").read_text()
    assert md.splitlines()[2].startswith("- BASELINE bf16") and "**FAIL fp8:broken" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "<script" not in html
    assert r["memory"]["fp8:calib"]["kv_bytes_per_token"] * 2 == r["memory"]["bf16"]["kv_bytes_per_token"]
    assert r["latency"]["fp8:calib"]["ttft"]["16"]["prefix_hit"]["ratio"] > 0
    assert r["scales"]["fp8:broken"]["k"][0][0] == pytest.approx(r["scales"]["fp8:calib"]["k"][0][0] / 64)
    assert r["environment"]["torch"] and len(r["setup"]["dataset_sha256"]) == 64
    assert r["setup"]["cpu_matmul"] == "float32"  # the bf16 model's linears multiplied in fp32, as asked


def test_compare_flags_an_injected_regression(llama, text_file, scales, tmp_path, capsys):
    calib, broken = scales
    scales_dir = tmp_path / "s"
    scales_dir.mkdir()
    for f in calib.iterdir():
        (scales_dir / f.name).write_bytes(f.read_bytes())
    common = [
        llama,
        "--configs",
        f"bf16,fp8:{scales_dir}",
        "--dataset",
        str(text_file),
        "--num-windows",
        "4",
        "--window",
        "64",
        *FAST,
    ]
    assert run([*common, "--report", str(tmp_path / "old")]) == 0
    # the same run again: nothing got worse
    assert run([*common, "--report", str(tmp_path / "same"), "--compare", str(tmp_path / "old" / "report.json")]) == 0
    assert json.loads((tmp_path / "same" / "report.json").read_text())["compare"]["flags"] == []
    # inject a regression: same label, scales / 64
    for f in broken.iterdir():
        (scales_dir / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()
    code = run([*common, "--report", str(tmp_path / "new"), "--compare", str(tmp_path / "old")])
    assert code == 1
    r = json.loads((tmp_path / "new" / "report.json").read_text())
    flagged = {(f["config"], f["metric"]) for f in r["compare"]["flags"]}
    # (a random tiny model's perplexity may even improve; its distribution moves away from the baseline's)
    assert {("fp8:s", "kl_mean"), ("fp8:s", "kl_p99"), ("fp8:s", "top1_agreement")} <= flagged
    assert not any(c == "bf16" for c, _ in flagged)
    assert "worse: fp8:s kl_mean" in capsys.readouterr().out


def test_compare_unit_latency_flags_warn_only():
    acc = {
        "ppl": 10.0,
        "ppl_ci95": [9, 11],
        "ppl_delta_pct": 0.5,
        "ppl_delta_pct_ci95": [0.2, 0.8],
        "kl_mean": 0.01,
        "kl_mean_ci95": [0.009, 0.011],
        "kl_p99": 0.1,
        "kl_p99_ci95": [0.09, 0.11],
        "top1_agreement": 0.95,
        "top1_agreement_ci95": [0.94, 0.96],
    }
    mem = {"kv_bytes_per_token": 100, "max_concurrent_seqs": 8, "kv_budget_bytes": 1, "memory_len": 1}
    lat = {
        "ttft": {
            "512": {
                "cold": {"ratio": 1.0, "ratio_range": [0.9, 1.1]},
                "prefix_hit": {"ratio": 1.0, "ratio_range": [0.9, 1.1]},
            }
        },
        "decode_per_token": {},
    }
    setup = {"dataset_sha256": "x", "num_windows": 1, "window": 2}
    old = {"accuracy": {"a": acc}, "memory": {"a": mem}, "latency": {"a": lat}, "setup": setup}
    new = json.loads(json.dumps(old))
    new["latency"]["a"]["ttft"]["512"]["cold"]["ratio"] = 1.5
    res = compare(new, old)
    assert [f["metric"] for f in res["flags"]] == ["ttft_cold_512_ratio"] and not res["failed"]
    assert compare(new, old, gate_latency=True)["failed"]
    new["memory"]["a"]["kv_bytes_per_token"] = 101
    assert compare(new, old)["failed"]


def test_compare_a_point_estimate_an_ulp_outside_its_own_interval_is_not_worse():
    """Windows that all score alike give a one-point bootstrap interval, which can sit an ulp below the point
    estimate (the tiny llama's 508.15064678509685 against [508.1506467850968] x 2): a rerun that reproduces the
    old value bit for bit must not be flagged, and one an ulp above it must."""
    ppl = 508.15064678509685
    ci = [508.1506467850968, 508.1506467850968]
    acc = {"ppl": ppl, "ppl_ci95": ci, "top1_agreement": 1.0, "top1_agreement_ci95": [1.0, 1.0]}
    setup = {"dataset_sha256": "x", "num_windows": 4, "window": 64}
    old = {"accuracy": {"bf16": acc}, "memory": {}, "latency": {}, "setup": setup}
    same = json.loads(json.dumps(old))
    assert compare(same, old) == {**compare(same, old), "flags": [], "failed": False}
    worse = json.loads(json.dumps(old))
    worse["accuracy"]["bf16"]["ppl"] = math.nextafter(ppl, math.inf)
    assert [(f["metric"], f["old_interval"]) for f in compare(worse, old)["flags"]] == [("ppl", [ci[0], ppl])]


# -- bad input: clear errors, no report left behind --------------------------------------------------
@pytest.mark.parametrize(
    "configs,msg",
    [
        ("bf16,fp9", "unknown configuration 'fp9'"),
        ("bf16,fp8+foo=1", "the modifiers are '+rot=hadamard|none' and '+skip=LAYERS'"),
        ("bf16,fp8:/no/such/dir", "do not exist"),
        ("bf16,fp8+skip=x", "neither 'sliding_window' nor a layer index"),
    ],
)
def test_unknown_config_is_a_clear_error(llama, tmp_path, capsys, configs, msg):
    out = tmp_path / "rep"
    assert run([llama, "--configs", configs, "--report", str(out), *FAST]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


def test_too_few_tokens(llama, tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("only a few words here\n")
    out = tmp_path / "rep"
    assert (
        run([llama, "--dataset", str(small), "--num-windows", "4", "--window", "64", "--report", str(out), *FAST]) == 2
    )
    assert "fewer than the 4 x 64" in capsys.readouterr().err
    assert not out.exists()


def test_ttft_length_above_max_model_len(llama, text_file, tmp_path, capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("scored before checking lengths")

    monkeypatch.setattr(accuracy, "score_windows", boom)
    out = tmp_path / "rep"
    assert (
        run(
            [
                llama,
                "--dataset",
                str(text_file),
                "--num-windows",
                "2",
                "--window",
                "32",
                "--max-model-len",
                "128",
                "--ttft-lengths",
                "64,512",
                "--report",
                str(out),
            ]
        )
        == 2
    )
    assert "--ttft-lengths 512 is longer than max_model_len=128" in capsys.readouterr().err
    assert not out.exists()


def test_compare_refuses_other_model_or_version(llama, tiny_dir, text_file, tmp_path, capsys):
    common = ["--dataset", str(text_file), "--num-windows", "2", "--window", "32", *FAST]
    assert run([llama, *common, "--report", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    other = str(tiny_dir("qwen3"))
    assert run([other, *common, "--report", str(tmp_path / "b"), "--compare", str(tmp_path / "a" / "report.json")]) == 2
    assert "refusing to compare" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    old = json.loads((tmp_path / "a" / "report.json").read_text())
    old["report_version"] = 0
    (tmp_path / "v0.json").write_text(json.dumps(old))
    assert run([llama, *common, "--report", str(tmp_path / "a"), "--compare", str(tmp_path / "v0.json")]) == 2
    assert "report version 0" in capsys.readouterr().err
    # the earlier report in "a" stays, but is marked as not from the latest run
    assert "earlier run" in (tmp_path / "a" / "EVAL_FAILED.txt").read_text()
    assert run([llama, *common, "--report", str(tmp_path / "a")]) == 0
    assert not (tmp_path / "a" / "EVAL_FAILED.txt").exists()


def test_config_grammar():
    cs = parse_configs("bf16,fp8,int8_per_token_head,fp8+skip=sliding_window/0;3")
    assert [c.label for c in cs] == ["bf16", "fp8", "int8_per_token_head", "fp8+skip=sliding_window/0/3"]
    assert cs[3].engine_kwargs()["kv_cache_dtype_skip_layers"] == ["sliding_window", 0, 3]
    assert cs[1].engine_kwargs()["kv_cache_dtype"] == "fp8_e4m3"
    assert cs[1].engine_kwargs()["kv_cache_dtype_skip_layers"] is None  # the engine (checkpoint) decides
    cs = parse_configs("fp8_per_token_head+rot=hadamard+skip=2,int8_per_token_head+skip=none+rot=none")
    assert [c.label for c in cs] == ["fp8_per_token_head+rot=hadamard+skip=2", "int8_per_token_head+rot=none+skip=none"]
    assert [(c.engine_kwargs()["kv_rotation"], c.engine_kwargs()["kv_cache_dtype_skip_layers"]) for c in cs] == [
        ("hadamard", [2]),
        ("none", []),
    ]
    for bad in ("fp8+rot=givens", "fp8+skip=1+bogus=2", "fp8+bogus"):
        with pytest.raises(ValueError):
            parse_configs(bad)


def test_skip_sliding_window_on_tiny_gemma(tiny_dir, text_file, tmp_path):
    gemma = str(tiny_dir("gemma3"))
    out = tmp_path / "g"
    assert (
        run(
            [
                gemma,
                "--configs",
                "bf16,fp8,fp8+skip=sliding_window",
                "--dataset",
                str(text_file),
                "--num-windows",
                "2",
                "--window",
                "48",
                "--report",
                str(out),
                *FAST,
            ]
        )
        == 0
    )
    r = json.loads((out / "report.json").read_text())
    assert [c["cache"] for c in r["configs"]] == ["bfloat16 x3", "fp8_e4m3 x3", "bfloat16 x2 + fp8_e4m3 x1"]
    assert r["accuracy"]["fp8+skip=sliding_window"]["kl_mean"] < r["accuracy"]["fp8"]["kl_mean"]


def test_wikitext_windows_from_the_local_copy(data_file):
    assert data.wikitext_test_file() == data_file(WIKITEXT_TEST)
    t = data.load_text("wikitext")
    assert "\r" not in t.text and t.text.startswith(" = Robert Boulter = \n")
    assert t.file_sha256 == "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"
