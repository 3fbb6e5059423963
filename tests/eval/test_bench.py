"""``qkv bench`` runs every mode end to end on a tiny model; the file holds what the README quotes.

Only what does not depend on timing is asserted: the structure, token counts, budgets in tokens,
prefix-cache hits and the baseline's own ratios.
"""

import json

import pytest

from qkv.cli import main


@pytest.fixture(scope="module")
def model(tiny_dir):
    return str(tiny_dir("llama"))


def bench(model, tmp_path, *argv):
    out = tmp_path / "bench.json"
    assert main(["bench", model, "--dtype", "float32", "-o", str(out), *argv]) == 0
    return json.loads(out.read_text())


# 6 requests of 40 + 10 tokens at an 80 KiB budget: bf16 must preempt, fp8 holds them all
BUDGET = ["--mode", "throughput", "--num-requests", "6", "--prompt-len", "40", "--output-len", "10"]
BUDGET += ["--kv-cache-memory", "80KiB"]


def test_throughput_at_a_fixed_budget(model, tmp_path):
    r = bench(
        model, tmp_path, *BUDGET, "--kv-cache-dtypes", "bf16,fp8,int8_per_token_head", "--repeats", "1", "--fits-all"
    )
    res = r["results"]
    ceiling = res.pop("bf16@fits-all")
    assert list(res) == ["bf16", "fp8", "int8_per_token_head"] and r["baseline"] == "bf16"
    # --fits-all: bf16 with 6 x ceil(50 / 16) = 24 blocks, every request running at once, none preempted
    assert ceiling["kv_budget_tokens"] == 24 * 16 and ceiling["kv_bytes_per_token"] == res["bf16"]["kv_bytes_per_token"]
    assert ceiling["runs"][0]["preemptions"] == 0 and ceiling["runs"][0]["peak_running"] == 6
    # tiny llama: 3 layers x 2 kv heads x head_dim 16; 80 KiB / (16 tokens x bytes per token) blocks, one null
    assert [res[k]["kv_bytes_per_token"] for k in res] == [3 * 2 * 2 * 16 * 2, 3 * 2 * 2 * 16, 3 * 2 * 2 * (16 + 4)]
    assert (
        [res[k]["kv_budget_tokens"] for k in res]
        == [(81920 // (16 * b) - 1) * 16 for b in (384, 192, 240)]
        == [192, 400, 320]
    )
    assert res["bf16"]["ratio_to_bf16"] == 1.0
    for k in res:
        run = res[k]["runs"][0]
        assert 1 <= run["peak_running"] <= 6 and run["preemptions"] >= 0
    # 6 requests of 50 tokens need 24 blocks of 16: bf16 (12 usable) must preempt, fp8 (25) holds them all
    assert res["bf16"]["runs"][0]["preemptions"] > 0
    assert res["fp8"]["runs"][0]["preemptions"] == 0 and res["fp8"]["runs"][0]["peak_running"] == 6
    assert r["params"]["num_requests"] == 6 and r["attention_backend"] == "cpu" and r["cpu_matmul"] == "model"
    assert r["kernel_build_seconds"] > 0 and len(r["env"]["load_average_before"]) == 3


def test_fits_all_is_refused_where_it_has_no_meaning(model, tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert main(["bench", model, "--mode", "latency", "--fits-all", "-o", out]) == 2
    assert "--fits-all: only --mode throughput has a KV budget to lift" in capsys.readouterr().err
    assert (
        main(
            [
                "bench",
                model,
                "--mode",
                "throughput",
                "--fits-all",
                "--num-requests",
                "8",
                "--max-num-seqs",
                "4",
                "-o",
                out,
            ]
        )
        == 2
    )
    assert "--fits-all: --max-num-seqs must be at least --num-requests (8)" in capsys.readouterr().err


def test_latency_against_transformers(model, tmp_path):
    r = bench(
        model,
        tmp_path,
        "--mode",
        "latency",
        "--kv-cache-dtypes",
        "bf16,fp8",
        "--batch-sizes",
        "1,3",
        "--prompt-len",
        "12",
        "--output-len",
        "4",
        "--repeats",
        "1",
    )
    row = r["results"]["batch_3"]
    assert list(row) == ["bf16", "fp8", "transformers"]
    assert row["bf16"]["decode_ratio_to_bf16"] == 1.0 and row["transformers"]["decode_ratio_to_transformers"] == 1.0
    assert all(v["ttft_ms"] > 0 and v["decode_tokens_per_s"] > 0 for v in row.values())


def test_latency_with_fp32_matmul_adds_the_equal_arithmetic_baseline(model, tmp_path):
    r = bench(
        model,
        tmp_path,
        "--mode",
        "latency",
        "--kv-cache-dtypes",
        "bf16",
        "--batch-sizes",
        "2",
        "--prompt-len",
        "12",
        "--output-len",
        "3",
        "--repeats",
        "1",
        "--dtype",
        "bfloat16",
        "--cpu-matmul-dtype",
        "float32",
    )
    assert r["dtype"] == "bfloat16" and r["cpu_matmul"] == "float32"
    row = r["results"]["batch_2"]
    assert list(row) == ["bf16", "transformers", "transformers+fp32"]
    assert row["transformers+fp32"]["ttft_ms"] > 0


def test_prefix_hit_ttft(model, tmp_path):
    r = bench(
        model,
        tmp_path,
        "--mode",
        "prefix",
        "--kv-cache-dtypes",
        "bf16,int8_per_token_head",
        "--prefix-len",
        "100",
        "--repeats",
        "1",
    )
    for label in ("bf16", "int8_per_token_head"):
        # prefix + 4 tokens = 104 tokens: the 6 full blocks of the prefix are hits
        assert r["results"][label]["cached_tokens"] == 96
    assert r["results"]["bf16"]["cold_ttft_ratio_to_bf16"] == 1.0


def test_prefix_tier_hit_ttft(model, tmp_path):
    r = bench(
        model,
        tmp_path,
        "--mode",
        "prefix",
        "--kv-cache-dtypes",
        "bf16,fp8",
        "--prefix-len",
        "100",
        "--repeats",
        "1",
        "--kv-offloading-size",
        "0.01",
        "--kv-offloading-dir",
        str(tmp_path / "tier"),
    )
    res = r["results"]
    assert list(res) == ["bf16+ram", "bf16+file", "fp8+ram", "fp8+file"]
    for label, block_bytes in (("bf16+ram", 6144), ("bf16+file", 6144), ("fp8+ram", 3072), ("fp8+file", 3072)):
        row, run = res[label], res[label]["tier_runs"][0]
        # the 6 full prefix blocks went to the tier on eviction and came back: 96 tokens, 6 blocks' bytes
        assert (row["tier_cached_tokens"], row["tier_hit_tokens"], row["tier_bytes_read"]) == (96, 96, 6 * block_bytes)
        assert (run["kv_offload_loaded_blocks"], run["same_token_as_device_hit"]) == (6, True)
        assert row["tier_hit_ttft_ms"] > 0 and 0 < row["tier_load_share_of_ttft"] < 1


def test_throughput_with_the_tier_against_the_same_engine_without_it(model, tmp_path):
    tier = ["--kv-offloading-size", "0.01", "--kv-offloading-dir", str(tmp_path / "tier")]
    r = bench(model, tmp_path, *BUDGET, "--kv-cache-dtypes", "bf16,fp8", "--repeats", "2", *tier)
    res = r["results"]
    assert list(res) == ["bf16", "bf16+ram", "bf16+file", "fp8", "fp8+ram", "fp8+file"]
    assert r["engine"]["enable_prefix_caching"] is True and "cpu_flags" in r["env"]
    assert "ratio_to_tier_off" not in res["bf16"] and "stored_blocks" not in res["bf16"]["runs"][0]
    for label in ("bf16+ram", "bf16+file", "fp8+ram", "fp8+file"):
        assert res[label]["ratio_to_tier_off"] > 0
        for run in res[label]["runs"]:  # the tier is emptied before each run: every run stores the same blocks
            # 6 requests x 49 computed tokens (40 + 10, the last never fed back): 3 full blocks each
            assert (run["stored_blocks"], run["skipped_blocks"]) == (18, 0)
    # the fp8 pool holds all 6 requests (no preemption, so nothing to reload); bf16 preempts and reloads
    assert [run["loaded_blocks"] for run in res["fp8+ram"]["runs"]] == [0, 0]
    assert res["bf16+ram"]["runs"][0]["preemptions"] > 0


def test_bad_dtype_is_a_clear_error(model, tmp_path, capsys):
    assert main(["bench", model, "--kv-cache-dtypes", "bf16,fp4", "-o", str(tmp_path / "x.json")]) == 2
    assert "'fp4' is not a kv-cache dtype" in capsys.readouterr().err
