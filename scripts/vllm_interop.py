"""What a qkv checkpoint is worth in vLLM: the same windows scored by qkv and by vLLM's CPU build, per config.

    .venv/bin/python scripts/vllm_interop.py [-o eval/results/vllm/interop_smollm2.json]

Calibrates SmolLM2-135M with ``qkv calibrate`` (fp8, 64 x 512 WikiText-2 validation tokens, per tensor and per
head) and exports it with ``qkv export-vllm --fold`` three ways (the same data: the toward-zero rounding
compensation that vLLM's CPU backend needs, that plus the V rotation, and K smoothing with the V rotation),
then scores the first 8 x 1,024
WikiText-2 test tokens (no BOS) in qkv (in-process, the default engine) and in vLLM (its prompt logprobs, one
engine per configuration, eager, from scripts/vllm_venv.sh's venv) with a bf16 cache, fp8 at scale 1.0, and
fp8 with each checkpoint (``qkv export-vllm``'s form, which for the per-tensor and per-head ones is the
checkpoint itself), plus what vLLM holds of each (its attention layers' ``_k_scale``/``_v_scale``
through ``LLM.apply_model``). qkv divides a toward-zero compensation out on load; the JSON also has qkv's
perplexity with it left in the weights (``qkv_fold_compensation_kept``), as an engine that rounds to nearest
and ignores the record would see it. The JSON has every perplexity, the deltas against each engine's own bf16, and the
scales held; the README's interop table is printed from it (``--table``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from qkv import LLM
from qkv.cli import main as qkv_main
from qkv.data_files import WIKITEXT_TEST, WIKITEXT_VALID, find_data_file
from qkv.eval.machine import cpu_info
from qkv.eval.vllm_engine import VllmEngine, vllm_fp8_supported
from qkv.model_loader import COMPENSATION_KEY, load_tokenizer
from qkv.registry import resolve_model
from qkv.scales import read_kv_scales
from qkv.scoring import prefill_logits

ROOT = Path(__file__).resolve().parent.parent
NUM_WINDOWS, WINDOW = 8, 1024
PLAIN = "fp8, qkv per-tensor scales"
FOLD = "fp8, `export-vllm --fold --fold-rounding toward-zero` (per-tensor scales)"


def windows(model_dir: Path) -> list[list[int]]:
    text = find_data_file(WIKITEXT_TEST).read_text(encoding="utf-8")[:400_000]
    ids = load_tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"]
    return [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(NUM_WINDOWS)]


def ppl(token_logprobs: list[list[float]]) -> float:
    return math.exp(-sum(map(sum, token_logprobs)) / sum(map(len, token_logprobs)))


def qkv_ppl(model: str, kv: str, wins: list[list[int]], shared=None) -> tuple[float, object]:
    llm = LLM(
        model,
        preloaded_model=shared,
        dtype="bfloat16",
        kv_cache_dtype=kv,
        kv_cache_memory=256 << 20,
        enable_prefix_caching=False,
    )
    lps = []
    for w in wins:
        logp = torch.log_softmax(prefill_logits(llm.llm_engine, w)[:-1].float(), -1)
        lps.append(logp.gather(1, torch.tensor(w[1:])[:, None])[:, 0].tolist())
    return ppl(lps), llm.llm_engine.model


def vllm_run(model: str, kv: str, wins: list[list[int]]) -> dict:
    spec = {"model": model, "kv_cache_dtype": kv, "kv_bytes": 256 << 20, "max_model_len": 2048, "enforce_eager": True}
    with VllmEngine(spec) as engine:
        lps, _ = engine.prompt_logprobs(wins)
        held = [row for worker in engine.kv_scales() for row in worker]
    return {
        "ppl": ppl(lps),
        "held_k_scale": [r["k_scale"] for r in held],
        "held_v_scale": [r["v_scale"] for r in held],
        "vllm": engine.info.get("vllm"),
    }


# the calibration text of both: 64 x 512 WikiText-2 validation tokens
DATA = ["--dataset", str(find_data_file(WIKITEXT_VALID)), "--num-samples", "64", "--seq-len", "512"]


def calibrate(out: Path, strategy: str) -> Path:
    argv = ["calibrate", "smollm2-135m", *DATA, "--kv-cache-dtype", "fp8", "--strategy", strategy, "--no-progress"]
    if qkv_main([*argv, "-o", str(out)]) != 0:
        raise SystemExit(f"qkv calibrate --strategy {strategy} failed")
    return out


def fold(out: Path, *flags: str) -> Path:
    if qkv_main(["export-vllm", "smollm2-135m", "--fold", *flags, *DATA, "-o", str(out)]) != 0:
        raise SystemExit("qkv export-vllm --fold failed")
    return out


def without_compensation(folded: Path, out: Path) -> Path:
    """``folded`` as an engine that rounds to nearest and ignores qkv's record would serve it: the factors
    stay in the weights (qkv divides them out on load when config.json names them)."""
    shutil.copytree(folded, out)
    cfg = json.loads((out / "config.json").read_text())
    del cfg[COMPENSATION_KEY]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def table(rep: dict) -> str:
    rows = [
        "| configuration | qkv ppl (Δ) | vLLM CPU ppl (Δ) | what vLLM holds |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, r in rep["configs"].items():
        q, v = r["qkv"], r["vllm"]
        qd = "" if name == "bf16" else f" ({q['delta_pct']:+.2f} %)"
        vd = "" if name == "bf16" or v.get("ppl") is None else f" ({v['delta_pct']:+.2f} %)"
        vp = "not run: " + v["skipped"] if "skipped" in v else f"{v['ppl']:.3f}{vd}"
        rows.append(f"| {name} | {q['ppl']:.3f}{qd} | {vp} | {r['held']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=str(ROOT / "eval/results/vllm/interop_smollm2.json"))
    ap.add_argument("--table", action="store_true", help="print the README table of an existing JSON")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.output).read_text())))
        return 0
    model = str(resolve_model("smollm2-135m"))
    wins = windows(Path(model))
    tmp = Path(tempfile.mkdtemp(prefix="qkv-interop-"))
    checkpoints = {
        PLAIN: calibrate(tmp / "tensor", "tensor"),
        "fp8, qkv per-head (attn_head) scales": calibrate(tmp / "head", "head"),
        FOLD: fold(tmp / "fold", "--fold-rounding", "toward-zero"),
        "fp8, `--fold --fold-rounding toward-zero --fold-v-rotation`": fold(
            tmp / "fold-rot", "--fold-rounding", "toward-zero", "--fold-v-rotation"
        ),
        "fp8, `--fold --fold-rounding nearest --alpha 0.5 --fold-v-rotation` (K smoothing, V rotation)": fold(
            tmp / "fold-smooth", "--fold-rounding", "nearest", "--alpha", "0.5", "--fold-v-rotation"
        ),
    }
    plan = [("bf16", model, "auto"), ("fp8, scale 1.0", model, "fp8")] + [
        (k, str(p), "fp8") for k, p in checkpoints.items()
    ]
    rep: dict = {
        "model": "smollm2-135m",
        "windows": f"first {NUM_WINDOWS} x {WINDOW} WikiText-2 test tokens, no BOS",
        "configs": {},
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": cpu_info(),
            "load_average_before": os.getloadavg(),
        },
    }
    shared = None
    kept = without_compensation(checkpoints[FOLD], tmp / "fold-kept")
    rep["qkv_fold_compensation_kept"] = {"ppl": qkv_ppl(str(kept), "fp8", wins)[0]}
    for name, path, kv in plan:
        q, shared = qkv_ppl(path, kv, wins, shared)
        row: dict = {"checkpoint": path if path != model else "the plain model", "qkv": {"ppl": q}}
        if kv == "fp8" and not vllm_fp8_supported():
            row["vllm"] = {"skipped": "vLLM's CPU fp8 cache needs AVX-512 or AMX"}
        else:
            row["vllm"] = vllm_run(path, kv, wins)
        scales = read_kv_scales(path) if path != model else None
        if scales is None:
            row["held"] = "no scales (1.0)" if kv == "fp8" else "-"
        else:
            want = [float(scales.k[i].max()) for i in sorted(scales.k)]
            held = [max(k) for k in row["vllm"].get("held_k_scale", [])]
            same = held == [torch.tensor(x).item() for x in want]
            per_head = scales.k[0].numel() > 1
            row["held"] = ("one scale per layer, the largest head's" if per_head else "qkv's scales exactly") + (
                "" if same else " (held scales differ from the file)"
            )
        rep["configs"][name] = row
        print(f"{name}: qkv {q:.4f}, vLLM {row['vllm'].get('ppl')}", flush=True)
    for side in ("qkv", "vllm"):
        base = rep["configs"]["bf16"][side].get("ppl")
        rows = list(rep["configs"].values()) + ([{"qkv": rep["qkv_fold_compensation_kept"]}] if side == "qkv" else [])
        for row in rows:
            if base and row[side].get("ppl"):
                row[side]["delta_pct"] = 100 * (row[side]["ppl"] / base - 1)
    plain, folded = (rep["configs"][k]["vllm"].get("delta_pct") for k in (PLAIN, FOLD))
    if plain and folded:
        rep["vllm_fold_delta_over_plain"] = folded / plain
    rep["env"]["load_average_after"] = os.getloadavg()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    print(table(rep))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
