"""``qkv calibrate``: observe K/V on calibration data, write a checkpoint that carries the scales.

    qkv calibrate MODEL --dataset D [--dataset-config C] [--split S] [--text-column COL]
        --num-samples N --seq-len L --kv-cache-dtype fp8|int8 --strategy tensor|head
        --observer minmax|percentile|mse [--percentile P] [--seed S]
        [--kv-rotation none|hadamard] [--auto-skip --max-ppl-delta 0.2%] -o OUT

Without ``--dataset`` the model calibrates on text it generates itself (data-free).
``--strategy channel`` and ``--kv-rotation hadamard`` are qkv extensions (see
calibrate/FORMAT.md); ``--auto-skip`` measures each layer's sensitivity on
held-out chunks and records the BF16 layers the engine then keeps by default.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from qkv.config_flags import add_config_args, add_engine_args, config_kwargs
from qkv.layer_specs import SKIP_DTYPES
from qkv.metrics import parse_threshold
from qkv.model_loader import load_tokenizer
from qkv.options import Checked, option
from qkv.registry import resolve_model
from qkv.scales import read_kv_scales

from .autoskip import FIGURE_FILE, STOP_RULES, kept_in, plot_sensitivity, select_skip_layers
from .checkpoint import vllm_note, vllm_readable, write_checkpoint
from .data import Samples, build_samples, load_rows
from .export import export_folded, export_vllm
from .report import summary_table
from .rounding import ROUNDINGS
from .run import CalibrationSpec, calibrate, load_engine

__all__ = ["CalibrateOptions", "register", "add_calibrate_args", "run_calibrate"]


WEIGHTS = ("link", "copy", "symlink")


def _nonempty(value: str) -> None:
    if not value:
        raise ValueError("must name the output model directory")


@dataclass
class CalibrateOptions(CalibrationSpec):
    """``qkv calibrate``'s flags: what to calibrate (:class:`~qkv.calibrate.run.CalibrationSpec`), on which data,
    with which auto-skip budget, and where to write. The engine's model, dtype and device are EngineConfig's."""

    dataset: str | None = option(
        None,
        "local .txt/.jsonl/.json/.parquet file or folder, or a hub dataset name; "
        "omit for data-free calibration on self-generated text",
    )
    dataset_config: str | None = option(None, "hub dataset configuration name")
    split: str | None = option(None, "dataset split (default: train)")
    text_column: str | None = option(None, "column with the text (default: 'messages' for chat rows, else 'text')")
    auto_skip: bool = option(
        False,
        "choose the fewest layers to keep in BF16 so that ppl stays within --max-ppl-delta "
        "on held-out chunks; written into the checkpoint and applied by default",
    )
    max_ppl_delta: str | None = option(None, "auto-skip's budget, e.g. 0.2%% (default 0.2%%)")
    auto_skip_stop: str | None = option(
        None,
        "when auto-skip's search meets the budget: 'upper' (default), when the upper end of the held-out change's "
        "95%% interval does, or 'point', when the change itself does (biased low where the search stops)",
        choices=STOP_RULES,
    )
    kv_cache_dtype_skip_dtype: str | None = option(
        None,
        "what the layers auto-skip keeps hold: auto (the model's dtype, default) or int8_per_token_head / "
        "fp8_per_token_head (qkv extension: half the bytes; the search then measures them so); written into "
        "the checkpoint and applied by default",
        choices=SKIP_DTYPES,
    )
    heldout_samples: int = option(
        16,
        "held-out chunks for --auto-skip (same dataset and --seq-len, never used for the scales). "
        "KV-quantization error grows with context, so calibrate at the context length you serve: 512-token "
        "chunks underestimate the cost at 1,024",
        ge=1,
    )
    output: str = option("", "output model directory", short="-o", required=True, check=_nonempty)
    overwrite: bool = option(False, "replace an earlier calibration output in -o")
    weights: str = option(
        "link", "how weights reach OUT: hard link (copy across filesystems), copy, or symlink", choices=WEIGHTS
    )
    threads: int | None = option(
        None, "CPU threads for torch (default: torch's choice; 1 is much faster on a busy machine)", ge=1
    )
    progress: bool = option(True, "show a progress bar")
    json: bool = option(False, "print calibration.json instead of the table")

    def spec(self) -> dict:
        """The :class:`CalibrationSpec` part, as :func:`~qkv.calibrate.run.calibrate`'s keywords."""
        return {f.name: getattr(self, f.name) for f in fields(CalibrationSpec)}


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, ("model", "dtype", "device"))  # the model as the engine loads it while observing
    add_config_args(p, CalibrateOptions)


def run_calibrate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model, dtype, device = args.model, args.dtype, args.device
    opts = CalibrateOptions(**config_kwargs(CalibrateOptions, args))  # every flag checked before anything loads
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    budget = None
    if opts.auto_skip:
        budget = parse_threshold(opts.max_ppl_delta or "0.2%", "--max-ppl-delta")
        if opts.dataset is None:
            raise ValueError("--auto-skip needs --dataset: its held-out chunks come from the same data")
    else:
        given = {
            "--max-ppl-delta": opts.max_ppl_delta,
            "--auto-skip-stop": opts.auto_skip_stop,
            "--kv-cache-dtype-skip-dtype": opts.kv_cache_dtype_skip_dtype,
        }
        named = [flag for flag, value in given.items() if value is not None]
        if named:
            raise ValueError(f"{', '.join(named)}: auto-skip's flag{'s' if len(named) > 1 else ''}; add --auto-skip")
    if opts.dataset is None and any(v is not None for v in (opts.dataset_config, opts.split, opts.text_column)):
        raise ValueError("--dataset-config/--split/--text-column need --dataset")
    out = Path(opts.output)
    if out.exists() and any(out.iterdir()) and not opts.overwrite:
        raise ValueError(f"-o {out} exists and is not empty; pass --overwrite or choose a new directory")
    raw = None
    if opts.dataset is not None:
        raw = load_rows(opts.dataset, opts.dataset_config, opts.split, opts.text_column)
    else:
        print("no --dataset: data-free calibration on text the model generates itself")
    samples, heldout = None, []
    if budget is not None:  # one draw, split: the held-out chunks never reach the scales
        both = build_samples(
            raw,
            load_tokenizer(resolve_model(model)),
            opts.num_samples + opts.heldout_samples,
            opts.seq_len,
            opts.seed,
            opts.packing,
        )
        samples = Samples(
            both.chunks[: opts.num_samples],
            dict(both.info, num_samples=opts.num_samples, heldout_samples=opts.heldout_samples),
        )
        heldout = both.chunks[opts.num_samples :]
    llm = None
    if budget is not None:  # one engine (unquantized cache) observes and then scores the held-out chunks
        llm = load_engine(model, dtype, seq_len=opts.seq_len, device=device)
    cal = calibrate(
        model,
        samples=samples,
        raw=None if samples else raw,
        dtype=dtype,
        device=device,
        progress=opts.progress,
        llm=llm,
        **opts.spec(),
    )
    if budget is not None:
        skip_dtype = opts.kv_cache_dtype_skip_dtype or "auto"
        cal.sensitivity = select_skip_layers(
            llm.llm_engine,
            cal,
            heldout,
            budget,
            opts.progress,
            stop=opts.auto_skip_stop or "upper",
            skip_dtype=skip_dtype,
        )
        cal.skip_layers, cal.skip_dtype = cal.sensitivity["skip_layers"], skip_dtype
    cal.wall_time_s = time.perf_counter() - t0  # dataset loading included
    write_checkpoint(cal, out, weights=opts.weights, overwrite=opts.overwrite)
    if cal.sensitivity is not None:
        plot_sensitivity(
            cal.sensitivity,
            f"{model} {cal.kv_dtype.name}/{cal.strategy}" + (f"/{cal.rotation}" if cal.rotation else ""),
            out / FIGURE_FILE,
        )
    if opts.json:
        print((out / "calibration.json").read_text())
    else:
        print(summary_table(cal))
        if cal.sensitivity is not None:
            s = cal.sensitivity
            print(
                f"auto-skip: keep layers {s['skip_layers'] or 'none'} in {kept_in(s.get('skip_dtype', 'auto'))} "
                f"-> ppl {s['ppl_delta_pct']:+.3f}% "
                "[{:+.2f}, {:+.2f}] ".format(*s["ppl_delta_pct_ci95"])
                + f"on {s['heldout']['windows']} held-out chunks (budget {s['max_ppl_delta_pct']:g}%, "
                f"stop: {s['stop']}); "
                f"figure: {out}/{FIGURE_FILE}"
            )
        where = (
            "compressed-tensors kv_cache_scheme (vLLM reads it)"
            if vllm_readable(cal)
            else f"qkv_kv_cache section (qkv only: {vllm_note(cal)})"
        )
        print(
            f"wrote {out} with {where}; load it with "
            f"`qkv generate {out} --kv-cache-dtype {cal.kv_dtype.name}` or pass --kv-scales {out}"
        )
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``calibrate`` to ``qkv``'s subcommands (called by qkv.cli)."""
    p = subparsers.add_parser(
        "calibrate",
        help="calibrate static FP8/INT8 KV-cache scales offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_calibrate_args(p)
    p.set_defaults(func=run_calibrate)
    register_export(subparsers)
    return p


@dataclass
class ExportOptions(Checked):
    """``qkv export-vllm``'s flags."""

    src: str = option(help="a `qkv calibrate` output directory; with --fold, the model itself")
    output: str = option("", "output model directory", short="-o", required=True, check=_nonempty)
    overwrite: bool = option(False, "replace an earlier export in -o")
    weights: str = option("link", "how weights reach OUT: hard link, copy, or symlink", choices=WEIGHTS)
    fold: bool = option(
        False,
        "fold changes into the weights that a stock engine with per-tensor fp8 scales gains from (the target's "
        "rounding compensation, and optionally K smoothing and the V rotation), then calibrate per-tensor "
        "scales on the folded model: a plain checkpoint that stock vLLM serves (calibrate/fold.py)",
    )
    dataset: str | None = option(None, "--fold: calibration text (as qkv calibrate's --dataset)")
    num_samples: int = option(64, "--fold: calibration samples", ge=1)
    seq_len: int = option(512, "--fold: tokens per sample", ge=1)
    alpha: float = option(0.0, "--fold: K smoothing exponent, s = max|K|^alpha (0: no smoothing)", ge=0)
    fold_v_rotation: bool = option(False, "--fold: fold the V Hadamard rotation into v_proj and o_proj")
    fold_rounding: str | None = option(
        None,
        "--fold (required with it): how the target back end rounds its fp8 cache writes; toward-zero (vLLM "
        "0.32's CPU backend) folds factors that undo its shrink of K and V into q_proj and o_proj "
        "(calibrate/rounding.py)",
        choices=ROUNDINGS,
    )


def run_export(args: argparse.Namespace) -> int:
    opts = ExportOptions(**config_kwargs(ExportOptions, args))
    if opts.fold:
        out, notes = export_folded(
            opts.src,
            opts.output,
            opts.dataset,
            opts.num_samples,
            opts.seq_len,
            opts.alpha,
            opts.overwrite,
            rotate_v=opts.fold_v_rotation,
            rounding=opts.fold_rounding,
        )
    else:
        out, notes = export_vllm(opts.src, opts.output, weights=opts.weights, overwrite=opts.overwrite)
    for n in notes:
        print(f"note: {n}")
    written = read_kv_scales(out)
    skip = written.skip_layers if written else None
    flags = f" --kv-cache-dtype-skip-layers {' '.join(map(str, skip))}" if skip else ""
    print(f"wrote {out}: compressed-tensors fp8 KV scales (vLLM: `vllm serve {out} --kv-cache-dtype fp8{flags}`)")
    return 0


def register_export(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export-vllm",
        help="write a qkv-calibrated checkpoint in the form vLLM reads",
        description="fp8 tensor/head scales pass through, per-channel scales are reduced "
        "to per-head; rotated or int8 scales are refused (vLLM cannot use them).",
    )
    add_config_args(p, ExportOptions)
    p.set_defaults(func=run_export)
    return p
