"""``python -m qkv.kernels.gpu_check --dry-run``: the GPU check's every part, on the CPU under the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is tests/kernels/...)


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "qkv.kernels.gpu_check", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert report["dry_run"] and not [k for k in report if k.endswith("_error")]
    assert [t["returncode"] for t in report["kernel_tests"]] == [0]
    assert set(report["split_check"]) == {"bfloat16", "fp8_e4m3", "int8", "int4_per_token_head"}
    assert all(v["ok"] and v["grid"][2] == 2 for v in report["split_check"].values())
    decode = report["decode"]
    assert len(decode) == 2 * 2 * 5 and not [r for r in decode if "error" in r]
    kernels = [r for r in decode if r["cache"] != "sdpa_contiguous_bf16"]
    assert all(r["finite"] and r["kernel_ms"] > 0 and r["fraction_of_hbm"] > 0 for r in kernels)
    assert {r["segments"] for r in kernels if r["context"] == 600} == {2}
    assert "## Decode attention" in (tmp_path / "gpu_check_dry_run.md").read_text()
