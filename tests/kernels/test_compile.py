"""Every kernel specialization qkv's launchers produce compiles for sm_80, sm_89, sm_90 and sm_100, without spills.

The compile itself runs ``python -m qkv.kernels.compile_check`` in a subprocess (Triton
must compile, not interpret, there) with a pool of 2 and a fresh Triton cache; it takes
minutes on 2 cores. The coverage checks run here on the captured launches.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402,F401 - a hard dependency (the test and triton extras): a missing one fails

from qkv.kernels.compile_check import ARCHS, RESULTS  # noqa: E402
from qkv.kernels.compile_specs import CACHE_CONFIGS, HEAD_DIMS, drive  # noqa: E402
from qkv.kernels.quant import STORAGE_DTYPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is tests/kernels/...)
MIN_PER_ARCH = 150


def _constexpr_names(kernel) -> list[str]:
    fn = getattr(kernel, "fn", kernel)
    return [n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)]


def test_driven_launches_cover_every_axis_and_every_constexpr():
    launches = drive(80) + drive(90)
    by_kernel: dict[str, list] = {}
    for launch in launches:
        by_kernel.setdefault(launch.name, []).append(launch)
    assert set(by_kernel) == {"_write_kv_kernel", "_paged_attention_kernel", "_merge_segments_kernel"}
    for name, group in by_kernel.items():
        for const in _constexpr_names(group[0].kernel):
            values = {repr(la.kwargs[const]) for la in group}
            assert len(values) >= 2, f"{name}.{const} takes only {values}: the driver never varies it"
    att = by_kernel["_paged_attention_kernel"]
    assert {la.kwargs["HEAD_DIM"] for la in att} == set(HEAD_DIMS)
    assert {la.kwargs["GROUP"] for la in att} == set(range(1, 9))
    assert {la.kwargs["USE_WINDOW"] for la in att} == {True, False}
    assert {la.kwargs["ROTATE"] for la in att} == {True, False}
    assert {la.kwargs["SPLIT"] for la in att} == {True, False}
    assert {la.kwargs["FP8_NATIVE"] for la in att} == {True, False}
    assert {la.kwargs["BLOCK_M"] for la in att} >= {16, 32, 64}  # decode and prefill tiles
    storages = {la.args[2].dtype for la in by_kernel["_write_kv_kernel"]}
    assert storages == {
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    }  # uint8: fp8 on sm_80
    names = {name for name, _ in CACHE_CONFIGS}
    assert names == set(STORAGE_DTYPES)
    assert {g for _, g in CACHE_CONFIGS} == {None, "tensor", "head", "channel"}


@pytest.mark.compile
def test_every_specialization_compiles_for_four_archs_without_spills(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = os.environ.get("QKV_COMPILE_JOBS", "2")  # 2 cores in CI; more where there are more
    proc = subprocess.run(
        [sys.executable, "-m", "qkv.kernels.compile_check", "--out", str(out), "--jobs", jobs],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    print(f"compile check: {summary}")
    problems = [
        (r["arch"], r["kernel"], r.get("error") or (r["spill_stores"], r["constexprs"]))
        for r in report["results"]
        if not r["ok"] or r["spill_stores"] or r["spill_loads"]
    ]
    assert not problems, problems[:5]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["archs"] == [f"sm_{a}" for a in ARCHS]
    for arch, v in report["per_arch"].items():
        assert v["specializations"] >= MIN_PER_ARCH and v["failures"] == 0 and v["spills"] == 0, (arch, v)

    # the committed results describe the same specializations with the same resources
    committed = json.loads(RESULTS.read_text())

    def resources(rep):
        return {
            (r["arch"], r["id"]): (r["reg"], r["stack"], r["spill_stores"], r["dynamic_shared"]) for r in rep["results"]
        }

    assert resources(committed) == resources(report), "regenerate: python -m qkv.kernels.compile_check"


_IDS = """
import json, sys
from qkv.kernels.compile_check import specializations
from qkv.kernels.compile_specs import drive
specs = [s for arch in (80, 90) for s in specializations(drive(arch), arch)]
print(json.dumps({"libs": sorted({s["_options"]["extern_libs"][0][1] for s in specs}),
                  "ids": sorted([s["arch"], s["id"]] for s in specs)}))
"""


def test_specialization_ids_match_the_committed_report_wherever_triton_is_installed():
    """Ids name a specialization, not a checkout: libdevice's path (inside site-packages) stays out of them.

    A relocated libdevice stands in for another venv; the ids must still equal the committed
    ones, or the slow compile test above fails on every machine but the one that wrote them.
    Seconds, not minutes: it captures and hashes, it does not compile.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_LIBDEVICE_PATH"] = "/elsewhere/site-packages/triton/lib/libdevice.10.bc"
    proc = subprocess.run([sys.executable, "-c", _IDS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["libs"] == [env["TRITON_LIBDEVICE_PATH"]]
    committed = json.loads(RESULTS.read_text())
    assert got["ids"] == sorted([r["arch"], r["id"]] for r in committed["results"] if r["arch"] in (80, 90))
