"""``qkv eval --search``: evaluate the dtype x strategy x rotation grid and recommend a configuration.

1. **Calibrate once.** One pass of the model over the calibration data (default:
   the WikiText-2 *validation* split, never the test windows) fills K/V
   statistics for every rotation in the grid at once; each (dtype, strategy,
   rotation) then gets minmax scales, written as a self-describing scales file
   under ``REPORT/scales/``. Samples are as long as the evaluation windows by
   default: per-channel K scales depend on position (RoPE turns each channel
   pair with it), and positions never seen in calibration saturate.
2. **Evaluate.** The grid (static fp8/int8 x tensor/head/channel x none/hadamard,
   the dynamic per-token-head modes with and without rotation, and vLLM's default
   uncalibrated fp8) goes through the ordinary ``qkv eval`` against the BF16
   baseline, in one run, on the same windows.
3. **Recommend.** Among configurations whose ppl delta is within
   ``--max-ppl-delta``, the one with the smallest KV footprint (bytes per token,
   dynamic scales included) wins; ties go to the smaller mean KL. (Between
   configurations of similar quality the ppl delta moves by +-0.2% with the
   particular rounding errors, while KL, averaged over every token's whole
   distribution, ranks them consistently.) The choice,
   the ranked table and the command lines to use it go to ``search.json`` and
   ``search.md`` beside the report.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from .run import EvalArgs, run_eval

__all__ = ["SearchArgs", "run_search", "recommend", "default_calibration_file", "rerender"]

logger = logging.getLogger("qkv.eval")
DYNAMIC = ("fp8_per_token_head", "int8_per_token_head")


@dataclass
class SearchArgs:
    dtypes: tuple[str, ...] = ("fp8", "int8")
    strategies: tuple[str, ...] = ("tensor", "head", "channel")
    rotations: tuple[str, ...] = ("none", "hadamard")
    dynamic: bool = True
    calib_dataset: str | None = None
    calib_samples: int = 64
    calib_seq_len: int | None = None  # default: the eval window, so scales see every position evaluated


def default_calibration_file() -> Path | None:
    """The shared WikiText-2 validation split beside the test split eval uses, if present."""
    from .data import wikitext_test_file
    test = wikitext_test_file()
    if test is None:
        return None
    cand = test.parent / "wiki.valid.tokens"
    return cand if cand.is_file() else None


def _check(search: SearchArgs) -> None:
    from qkv.calibrate.run import ROTATIONS, STRATEGIES
    bad = [d for d in search.dtypes if d not in ("fp8", "int8")]
    bad += [s for s in search.strategies if s not in STRATEGIES]
    bad += [r for r in search.rotations if r not in ROTATIONS]
    if bad:
        raise ValueError(f"--search grid: {bad[0]!r} is not one of dtypes fp8/int8, strategies "
                         f"{'/'.join(STRATEGIES)}, rotations {'/'.join(ROTATIONS)}")
    if not search.dtypes or not search.strategies or not search.rotations:
        raise ValueError("--search needs at least one dtype, strategy and rotation")


def calibrate_grid(model: str, search: SearchArgs, out_dir: Path, dtype: str, seed: int,
                   device: str | None) -> tuple[list[str], dict]:
    """Observe once, write one scales file per (dtype, strategy, rotation); return eval specs and a record."""
    from qkv.calibrate.checkpoint import write_scales_file
    from qkv.calibrate.data import build_samples, load_rows
    from qkv.calibrate.observers import MinMax
    from qkv.calibrate.run import Calibration, choose_scales, load_engine, observe, resolve_target

    dataset = search.calib_dataset or default_calibration_file()
    if dataset is None:
        raise ValueError("--search needs calibration text: pass --calib-dataset (the WikiText-2 validation "
                         "split is used when the shared copy is present)")
    t0 = time.perf_counter()
    raw = load_rows(str(dataset))
    llm = load_engine(model, dtype, num_blocks=-(-search.calib_seq_len // 16) + 3, device=device,
                      max_num_batched_tokens=max(2048, search.calib_seq_len))
    engine = llm.llm_engine
    samples = build_samples(raw, engine.tokenizer, search.calib_samples, search.calib_seq_len, seed)
    sets = observe(engine, samples.chunks, rotations=tuple(search.rotations), progress=False)
    if len(search.rotations) == 1:
        sets = {search.rotations[0]: sets}
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = []
    obs = MinMax()
    for name in search.dtypes:
        for strategy in search.strategies:
            dt = resolve_target(name, strategy)
            for rot in search.rotations:
                cal = Calibration(model=model, model_path=engine.model_path, kv_dtype=dt, strategy=strategy,
                                  observer=obs.describe(), layers=choose_scales(sets[rot], obs, dt, strategy),
                                  samples_info=samples.info, num_samples=len(samples.chunks),
                                  num_tokens=samples.num_tokens, model_dtype=str(engine.dtype), seed=seed,
                                  rotation=None if rot == "none" else rot)
                path = write_scales_file(cal, out_dir / f"{name}-{strategy}-{rot}.safetensors")
                specs.append(f"{name}:{path}")
    record = {"dataset": str(dataset), "samples": len(samples.chunks), "seq_len": search.calib_seq_len,
              "tokens": samples.num_tokens, "observer": "minmax", "seconds": round(time.perf_counter() - t0, 1)}
    del llm, engine
    return specs, record


def grid_specs(search: SearchArgs, static_specs: list[str]) -> list[str]:
    specs = ["bf16", "fp8"] + static_specs  # baseline, vLLM's uncalibrated default, the calibrated grid
    if search.dynamic:
        for name in DYNAMIC:
            for rot in search.rotations:
                specs.append(name if rot == "none" else f"{name}+rot={rot}")
    return specs


def recommend(report: dict, budget: float) -> dict:
    """Smallest bytes/token within the ppl budget (ties: smaller mean KL); every candidate ranked."""
    base = report["baseline"]
    rows = []
    for label, acc in report["accuracy"].items():
        if label == base:
            continue
        rows.append({"config": label,
                     "spec": next(c["spec"] for c in report["configs"] if c["label"] == label),
                     "kv_bytes_per_token": report["memory"][label]["kv_bytes_per_token"],
                     "ppl_delta_pct": acc["ppl_delta_pct"], "ppl_delta_pct_ci95": acc["ppl_delta_pct_ci95"],
                     "kl_mean": acc["kl_mean"], "top1_agreement": acc["top1_agreement"],
                     "within_budget": acc["ppl_delta_pct"] <= budget})
    rows.sort(key=lambda r: (not r["within_budget"], r["kv_bytes_per_token"], r["kl_mean"]))
    best = rows[0] if rows and rows[0]["within_budget"] else None
    return {"max_ppl_delta_pct": budget, "baseline": base,
            "baseline_kv_bytes_per_token": report["memory"][base]["kv_bytes_per_token"],
            "recommended": best, "ranked": rows}


def _flags(spec: str) -> str:
    from .configs import parse_config
    c = parse_config(spec)
    out = f"--kv-cache-dtype {c.kv_cache_dtype}"
    if c.scales:
        out += f" --kv-scales {c.scales}"
    if c.rotation != "auto":
        out += f" --kv-rotation {c.rotation}"
    return out


def search_markdown(rec: dict, model: str, calib: dict) -> str:
    lines = [f"# qkv eval --search: {model}", "",
             f"Budget: ppl delta <= {rec['max_ppl_delta_pct']:g}% against {rec['baseline']} "
             f"({rec['baseline_kv_bytes_per_token']:,} B/token). Scales: minmax on {calib['samples']} x "
             f"{calib['seq_len']} tokens of {Path(calib['dataset']).name}.", ""]
    best = rec["recommended"]
    if best:
        lines += [f"**Recommended: `{best['config']}`**: {best['kv_bytes_per_token']:,} B/token "
                  f"({rec['baseline_kv_bytes_per_token'] / best['kv_bytes_per_token']:.2f}x less than "
                  f"{rec['baseline']}), ppl {best['ppl_delta_pct']:+.3f}% "
                  f"[{best['ppl_delta_pct_ci95'][0]:+.3f}, {best['ppl_delta_pct_ci95'][1]:+.3f}]", "",
                  f"    qkv serve {model} {_flags(best['spec'])}", ""]
    else:
        lines += ["**No configuration is within the budget**; keep the baseline or skip layers "
                  "(`qkv calibrate --auto-skip`).", ""]
    lines += ["| configuration | B/token | ppl delta % [95% CI] | mean KL | top-1 | within budget |",
              "| --- | ---: | --- | ---: | ---: | :---: |"]
    for r in rec["ranked"]:
        lo, hi = r["ppl_delta_pct_ci95"]
        lines.append(f"| {r['config']} | {r['kv_bytes_per_token']:,} | {r['ppl_delta_pct']:+.3f} "
                     f"[{lo:+.3f}, {hi:+.3f}] | {r['kl_mean']:.5f} | {100 * r['top1_agreement']:.2f}% | "
                     f"{'yes' if r['within_budget'] else 'no'} |")
    return "\n".join(lines) + "\n"


def run_search(args: EvalArgs, search: SearchArgs) -> tuple[dict, dict, int]:
    """Calibrate the grid, evaluate it, recommend; returns (report, recommendation, exit code)."""
    from .gate import parse_threshold
    _check(search)
    budget = parse_threshold(args.max_ppl_delta, "--max-ppl-delta")
    if budget is None:
        raise ValueError("--search needs --max-ppl-delta (the budget the recommendation must meet)")
    out = Path(args.report)
    if search.calib_seq_len is None:
        search.calib_seq_len = args.window
    static, calib = calibrate_grid(args.model, search, out / "scales", args.dtype, args.seed, args.device)
    args.configs = grid_specs(search, static)
    args.max_ppl_delta = None  # the grid is expected to hold failures: the search reports, it does not gate
    report, _ = run_eval(args)
    rec = recommend(report, budget)
    rec["calibration"] = calib
    (out / "search.json").write_text(json.dumps(rec, indent=2) + "\n")
    (out / "search.md").write_text(search_markdown(rec, args.model, calib))
    return report, rec, 0 if rec["recommended"] else 1


def rerender(report_dir: str | Path) -> dict:
    """Recompute ``search.json``/``search.md`` from a finished run's ``report.json`` (after a ranking change)."""
    d = Path(report_dir)
    report = json.loads((d / "report.json").read_text())
    old = json.loads((d / "search.json").read_text())
    rec = recommend(report, old["max_ppl_delta_pct"])
    rec["calibration"] = old["calibration"]
    (d / "search.json").write_text(json.dumps(rec, indent=2) + "\n")
    (d / "search.md").write_text(search_markdown(rec, report["model"]["name"], rec["calibration"]))
    return rec
