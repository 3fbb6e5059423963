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

from qkv.calibrate import CALIBRATED_DTYPES, STRATEGIES, calibrate_grid, load_rows, write_scales_file
from qkv.kernels.quant import DYNAMIC_CACHE_DTYPES, ROTATIONS, resolve_cache_dtype
from qkv.metrics import parse_threshold
from qkv.options import option

from .configs import EvalConfig, parse_config
from .data import wikitext_valid_file
from .run import EvalArgs, run_eval

__all__ = ["SearchArgs", "run_search", "recommend", "rerender", "STATIC_DTYPES"]

logger = logging.getLogger("qkv.eval")


def _one_name_each(names: tuple[str, ...]) -> tuple[str, ...]:
    """The first spelling of each distinct dtype: ``("fp8", "fp8_e4m3", "int8")`` -> ``("fp8", "int8")``."""
    out: dict[str, str] = {}
    for n in names:
        out.setdefault(resolve_cache_dtype(n).name, n)
    return tuple(out.values())


DYNAMIC = DYNAMIC_CACHE_DTYPES
# the static dtypes of the grid (calibration also makes clipping ratios for the 4-bit per-token modes, which the
# grid evaluates uncalibrated, with the other per-token modes)
STATIC_DTYPES = _one_name_each(tuple(n for n in CALIBRATED_DTYPES if not resolve_cache_dtype(n).dynamic))


@dataclass
class SearchArgs:
    """``qkv eval --search``'s options (flags ``--search-*`` and ``--calib-*``)."""

    search: bool = option(
        False,
        "calibrate and evaluate the dtype x strategy x rotation grid (replaces --configs) and recommend the "
        "smallest KV footprint within --max-ppl-delta",
    )
    dtypes: list[str] = option(
        help="static dtypes of the grid", default_factory=lambda: list(STATIC_DTYPES), sep=",", flag="--search-dtypes"
    )
    strategies: list[str] = option(
        help="scale granularities of the grid",
        default_factory=lambda: list(STRATEGIES),
        sep=",",
        flag="--search-strategies",
    )
    rotations: list[str] = option(
        help="rotations of the grid", default_factory=lambda: list(ROTATIONS), sep=",", flag="--search-rotations"
    )
    dynamic: bool = option(True, "the per-token-head modes in the grid", flag="--search-dynamic")
    calib_dataset: str | None = option(
        None, "calibration text for the grid's scales (default: the WikiText-2 validation split)"
    )
    calib_samples: int = option(64, "calibration samples", ge=1)
    calib_seq_len: int | None = option(
        None, "tokens per calibration sample (default: --window, so every evaluated position is seen)", ge=1
    )


def _check(search: SearchArgs) -> None:
    """Names only, before anything loads; each layer's head_dim meets the rotation when the grid is observed."""
    bad = [d for d in search.dtypes if d not in STATIC_DTYPES] + [s for s in search.strategies if s not in STRATEGIES]
    bad += [r for r in search.rotations if r not in ROTATIONS]
    if bad:
        raise ValueError(
            f"--search grid: {bad[0]!r} is not one of dtypes {'/'.join(STATIC_DTYPES)}, "
            f"strategies {'/'.join(STRATEGIES)}, rotations {'/'.join(ROTATIONS)}"
        )
    if not search.dtypes or not search.strategies or not search.rotations:
        raise ValueError("--search needs at least one dtype, strategy and rotation")


def calibrate_grid_files(
    model: str, search: SearchArgs, out_dir: Path, dtype: str, seed: int, device: str | None
) -> tuple[list[str], dict]:
    """Observe once, write one scales file per (dtype, strategy, rotation); return eval specs and a record."""
    dataset = search.calib_dataset or wikitext_valid_file()
    if dataset is None:
        raise ValueError(
            "--search needs calibration text: pass --calib-dataset (the WikiText-2 validation "
            "split is used when a local copy is found, see qkv.data_files)"
        )
    t0 = time.perf_counter()
    targets = [
        (name, strategy, rot) for name in search.dtypes for strategy in search.strategies for rot in search.rotations
    ]
    cals = calibrate_grid(
        model,
        load_rows(str(dataset)),
        targets,
        num_samples=search.calib_samples,
        seq_len=search.calib_seq_len,
        seed=seed,
        dtype=dtype,
        device=device,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [
        f"{name}:{write_scales_file(cal, out_dir / f'{name}-{strategy}-{rot}.safetensors')}"
        for (name, strategy, rot), cal in zip(targets, cals)
    ]
    record = {
        "dataset": str(dataset),
        "samples": cals[0].num_samples,
        "seq_len": search.calib_seq_len,
        "tokens": cals[0].num_tokens,
        "observer": "minmax",
        "seconds": round(time.perf_counter() - t0, 1),
    }
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
        rows.append(
            {
                "config": label,
                "spec": next(c["spec"] for c in report["configs"] if c["label"] == label),
                "kv_bytes_per_token": report["memory"][label]["kv_bytes_per_token"],
                "ppl_delta_pct": acc["ppl_delta_pct"],
                "ppl_delta_pct_ci95": acc["ppl_delta_pct_ci95"],
                "kl_mean": acc["kl_mean"],
                "top1_agreement": acc["top1_agreement"],
                "within_budget": acc["ppl_delta_pct"] <= budget,
            }
        )
    rows.sort(key=lambda r: (not r["within_budget"], r["kv_bytes_per_token"], r["kl_mean"]))
    best = rows[0] if rows and rows[0]["within_budget"] else None
    return {
        "max_ppl_delta_pct": budget,
        "baseline": base,
        "baseline_kv_bytes_per_token": report["memory"][base]["kv_bytes_per_token"],
        "recommended": best,
        "ranked": rows,
    }


def _flags(spec: str) -> str:
    c = parse_config(spec)
    assert isinstance(c, EvalConfig)  # the grid holds qkv configurations only
    out = f"--kv-cache-dtype {c.kv_cache_dtype}"
    if c.scales:
        out += f" --kv-scales {c.scales}"
    if c.rotation != "auto":
        out += f" --kv-rotation {c.rotation}"
    return out


def search_markdown(rec: dict, model: str, calib: dict) -> str:
    lines = [
        f"# qkv eval --search: {model}",
        "",
        f"Budget: ppl delta <= {rec['max_ppl_delta_pct']:g}% against {rec['baseline']} "
        f"({rec['baseline_kv_bytes_per_token']:,} B/token). Scales: minmax on {calib['samples']} x "
        f"{calib['seq_len']} tokens of {Path(calib['dataset']).name}.",
        "",
    ]
    best = rec["recommended"]
    if best:
        lines += [
            f"**Recommended: `{best['config']}`**: {best['kv_bytes_per_token']:,} B/token "
            f"({rec['baseline_kv_bytes_per_token'] / best['kv_bytes_per_token']:.2f}x less than "
            f"{rec['baseline']}), ppl {best['ppl_delta_pct']:+.3f}% "
            f"[{best['ppl_delta_pct_ci95'][0]:+.3f}, {best['ppl_delta_pct_ci95'][1]:+.3f}]",
            "",
            f"    qkv serve {model} {_flags(best['spec'])}",
            "",
        ]
    else:
        lines += [
            "**No configuration is within the budget**; keep the baseline or skip layers "
            "(`qkv calibrate --auto-skip`).",
            "",
        ]
    lines += [
        "| configuration | B/token | ppl delta % [95% CI] | mean KL | top-1 | within budget |",
        "| --- | ---: | --- | ---: | ---: | :---: |",
    ]
    for r in rec["ranked"]:
        lo, hi = r["ppl_delta_pct_ci95"]
        lines.append(
            f"| {r['config']} | {r['kv_bytes_per_token']:,} | {r['ppl_delta_pct']:+.3f} "
            f"[{lo:+.3f}, {hi:+.3f}] | {r['kl_mean']:.5f} | {100 * r['top1_agreement']:.2f}% | "
            f"{'yes' if r['within_budget'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def run_search(args: EvalArgs, search: SearchArgs) -> tuple[dict, dict, int]:
    """Calibrate the grid, evaluate it, recommend; returns (report, recommendation, exit code)."""
    _check(search)
    budget = parse_threshold(args.max_ppl_delta, "--max-ppl-delta")
    if budget is None:
        raise ValueError("--search needs --max-ppl-delta (the budget the recommendation must meet)")
    out = Path(args.report)
    if search.calib_seq_len is None:
        search.calib_seq_len = args.window
    static, calib = calibrate_grid_files(args.model, search, out / "scales", args.dtype, args.seed, args.device)
    args.configs = ",".join(grid_specs(search, static))
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
