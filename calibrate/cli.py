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
import inspect
import time
from pathlib import Path
from typing import Any

import torch

from qkv.config_flags import add_engine_args
from qkv.kernels.quant import ROTATIONS
from qkv.metrics import parse_threshold
from qkv.model_loader import load_tokenizer
from qkv.registry import resolve_model
from qkv.scales import read_kv_scales

from .autoskip import FIGURE_FILE, plot_sensitivity, select_skip_layers
from .checkpoint import vllm_note, vllm_readable, write_checkpoint
from .data import Samples, build_samples, load_rows
from .export import export_vllm
from .observers import OBSERVER_NAMES
from .report import summary_table
from .run import STRATEGIES, calibrate, load_engine, resolve_target

__all__ = ["register", "add_calibrate_args", "run_calibrate"]


# calibrate()'s keyword defaults are the command's: written once, in calibrate/run.py.
_DEFAULTS: dict[str, Any] = {k: v.default for k, v in inspect.signature(calibrate).parameters.items()}


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, ("model", "dtype", "device"))  # the model as the engine loads it while observing
    p.add_argument(
        "--dataset",
        default=None,
        help="local .txt/.jsonl/.json/.parquet file or folder, or a hub dataset name; "
        "omit for data-free calibration on self-generated text",
    )
    p.add_argument("--dataset-config", default=None, help="hub dataset configuration name")
    p.add_argument("--split", default=None, help="dataset split (default: train)")
    p.add_argument(
        "--text-column", default=None, help="column with the text (default: 'messages' for chat rows, else 'text')"
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=_DEFAULTS["num_samples"],
        help="number of calibration samples (default %(default)s)",
    )
    p.add_argument("--seq-len", type=int, default=_DEFAULTS["seq_len"], help="tokens per sample (default %(default)s)")
    p.add_argument(
        "--packing",
        choices=["auto", "pack", "truncate"],
        default=_DEFAULTS["packing"],
        help="pack documents into seq-len chunks, or one truncated sample per row "
        "(auto: truncate for chat rows, pack otherwise)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=_DEFAULTS["kv_cache_dtype"],
        choices=["fp8", "fp8_e4m3", "int8"],
        help="cache dtype the scales are for (default fp8 = e4m3)",
    )
    p.add_argument(
        "--strategy",
        default=_DEFAULTS["strategy"],
        choices=STRATEGIES,
        help="one scale per layer for K and for V, one per kv head (compressed-tensors attn_head), "
        "or one per kv head and channel (qkv extension: K folded into q, V into the output)",
    )
    p.add_argument(
        "--kv-rotation",
        default=_DEFAULTS["rotation"],
        choices=ROTATIONS,
        help="qkv extension: calibrate scales of Hadamard-rotated K/V (the engine then rotates)",
    )
    p.add_argument(
        "--auto-skip",
        action="store_true",
        help="choose the fewest layers to keep in BF16 so that ppl stays within --max-ppl-delta "
        "on held-out chunks; written into the checkpoint and applied by default",
    )
    p.add_argument("--max-ppl-delta", default=None, help="auto-skip's budget, e.g. 0.2%% (default 0.2%%)")
    p.add_argument(
        "--heldout-samples",
        type=int,
        default=16,
        help="held-out chunks for --auto-skip (same dataset and --seq-len, never used for the scales; "
        "default 16). KV-quantization error grows with context, so calibrate at the context "
        "length you serve: 512-token chunks underestimate the cost at 1,024",
    )
    p.add_argument(
        "--observer",
        default=_DEFAULTS["observer"],
        choices=OBSERVER_NAMES,
        help="minmax: absmax over all samples; percentile: clip at --percentile of |x|; "
        "mse: clipping ratio with the least quantize-dequantize error",
    )
    p.add_argument("--percentile", type=float, default=None, help="for --observer percentile (default 99.99)")
    p.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="seed for the sample draw (default %(default)s)")
    p.add_argument("-o", "--output", required=True, help="output model directory")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier calibration output in -o")
    p.add_argument(
        "--weights",
        choices=["link", "copy", "symlink"],
        default="link",
        help="how weights reach OUT: hard link (copy across filesystems), copy, or symlink",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice; 1 is much faster on a busy machine)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print calibration.json instead of the table")


def run_calibrate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    resolve_target(args.kv_cache_dtype, args.strategy, args.observer)  # fail on bad flags before loading anything
    if args.percentile is not None and args.observer != "percentile":
        raise ValueError("--percentile only applies to --observer percentile")
    budget = None
    if args.auto_skip:
        budget = parse_threshold(args.max_ppl_delta or "0.2%", "--max-ppl-delta")
        if args.dataset is None:
            raise ValueError("--auto-skip needs --dataset: its held-out chunks come from the same data")
        if args.heldout_samples < 1:
            raise ValueError(f"--heldout-samples must be >= 1, got {args.heldout_samples}")
    elif args.max_ppl_delta is not None:
        raise ValueError("--max-ppl-delta is auto-skip's budget; add --auto-skip")
    if args.dataset is None and any(v is not None for v in (args.dataset_config, args.split, args.text_column)):
        raise ValueError("--dataset-config/--split/--text-column need --dataset")
    out = Path(args.output)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"-o {out} exists and is not empty; pass --overwrite or choose a new directory")
    raw = None
    if args.dataset is not None:
        raw = load_rows(args.dataset, args.dataset_config, args.split, args.text_column)
    else:
        print("no --dataset: data-free calibration on text the model generates itself")
    samples, heldout = None, []
    if budget is not None:  # one draw, split: the held-out chunks never reach the scales
        both = build_samples(
            raw,
            load_tokenizer(resolve_model(args.model)),
            args.num_samples + args.heldout_samples,
            args.seq_len,
            args.seed,
            args.packing,
        )
        samples = Samples(
            both.chunks[: args.num_samples],
            dict(both.info, num_samples=args.num_samples, heldout_samples=args.heldout_samples),
        )
        heldout = both.chunks[args.num_samples :]
    llm = None
    if budget is not None:  # one engine (unquantized cache) observes and then scores the held-out chunks
        llm = load_engine(args.model, args.dtype, seq_len=args.seq_len, device=args.device)
    cal = calibrate(
        args.model,
        samples=samples,
        raw=None if samples else raw,
        kv_cache_dtype=args.kv_cache_dtype,
        strategy=args.strategy,
        observer=args.observer,
        percentile=args.percentile,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        seed=args.seed,
        packing=args.packing,
        dtype=args.dtype,
        device=args.device,
        progress=args.progress,
        rotation=args.kv_rotation,
        llm=llm,
    )
    if budget is not None:
        cal.sensitivity = select_skip_layers(llm.llm_engine, cal, heldout, budget, args.progress)
        cal.skip_layers = cal.sensitivity["skip_layers"]
    cal.wall_time_s = time.perf_counter() - t0  # dataset loading included
    write_checkpoint(cal, out, weights=args.weights, overwrite=args.overwrite)
    if cal.sensitivity is not None:
        plot_sensitivity(
            cal.sensitivity,
            f"{args.model} {cal.kv_dtype.name}/{cal.strategy}" + (f"/{cal.rotation}" if cal.rotation else ""),
            out / FIGURE_FILE,
        )
    if args.json:
        print((out / "calibration.json").read_text())
    else:
        print(summary_table(cal))
        if cal.sensitivity is not None:
            s = cal.sensitivity
            print(
                f"auto-skip: keep layers {s['skip_layers'] or 'none'} in BF16 -> ppl {s['ppl_delta_pct']:+.3f}% "
                f"on {s['heldout']['windows']} held-out chunks (budget {s['max_ppl_delta_pct']:g}%); "
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


def run_export(args: argparse.Namespace) -> int:
    out, notes = export_vllm(args.src, args.output, weights=args.weights, overwrite=args.overwrite)
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
    p.add_argument("src", help="a `qkv calibrate` output directory")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--weights", choices=["link", "copy", "symlink"], default="link")
    p.set_defaults(func=run_export)
    return p
