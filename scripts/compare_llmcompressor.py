"""Check that qkv's minmax fp8 scales agree with llm-compressor's ``static_minmax`` on identical data.

    python scripts/compare_llmcompressor.py --lc-python LC_VENV/bin/python [--model smollm2-135m]
        [--num-samples 128] [--seq-len 512] [--strategy tensor] [--workdir DIR]

1. draws the token chunks with qkv's own data pipeline (WikiText-2 validation,
   found by :mod:`qkv.data_files`, seed 0) and dumps them to ``WORKDIR/chunks.json``;
2. runs llm-compressor in its own virtual environment (``--lc-python`` or
   ``$QKV_LC_PYTHON``; see scripts/README.md for setting it up) through
   ``scripts/lc_oneshot.py``: float32 model, KV-only recipe with ``observer: static_minmax``;
3. runs qkv's minmax observer on the same chunks with the model in float32;
4. writes a per-layer table (scales and relative differences) to
   ``calibrate/results/llmcompressor_agreement.md``.

Only the table is meant to be committed; llm-compressor's checkpoint stays in WORKDIR
(a new temporary directory unless ``--workdir`` is given).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from qkv.calibrate import Samples, build_samples, calibrate, load_rows
from qkv.data_files import WIKITEXT_VALID, find_data_file, not_found
from qkv.model_loader import load_tokenizer
from qkv.registry import resolve_model

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "calibrate" / "results"


def _lc_scales(out: Path) -> dict[tuple[int, str], torch.Tensor]:
    name = re.compile(r"layers\.(\d+)\.self_attn\.(k|v)_scale$")
    scales = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                m = name.search(n)
                if m:
                    scales[int(m.group(1)), m.group(2)] = fh.get_tensor(n).float().reshape(-1)
    if not scales:
        raise SystemExit(f"no k_scale/v_scale tensors in {out}")
    return scales


def _lc_version(lc_python: str) -> str:
    r = subprocess.run(
        [
            lc_python,
            "-c",
            "import importlib.metadata as m; print(m.version('llmcompressor'), "
            "m.version('compressed-tensors'), m.version('transformers'), m.version('torch'))",
        ],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() if r.returncode == 0 else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default=None, help=f"calibration text (default: {WIKITEXT_VALID} by qkv.data_files)")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", choices=["tensor", "head"], default="tensor")
    ap.add_argument(
        "--lc-python",
        default=os.environ.get("QKV_LC_PYTHON"),
        help="python of the virtual environment that has llmcompressor (default: $QKV_LC_PYTHON)",
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="for chunks.json and llm-compressor's checkpoint (default: a new temporary directory)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both runs (default 1)")
    ap.add_argument("--reuse-lc", action="store_true", help="reuse llm-compressor's output in WORKDIR")
    ap.add_argument("--output", default=str(RESULTS / "llmcompressor_agreement.md"))
    args = ap.parse_args(argv)
    if not args.lc_python:
        ap.error("name llm-compressor's python with --lc-python or $QKV_LC_PYTHON (see scripts/README.md)")
    if args.reuse_lc and not args.workdir:
        ap.error("--reuse-lc needs the --workdir of the earlier run")
    dataset = args.dataset or find_data_file(WIKITEXT_VALID)
    if dataset is None:
        ap.error(f"pass --dataset: {not_found(WIKITEXT_VALID)}")

    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qkv-lc-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    tok = load_tokenizer(model_path)
    samples = build_samples(load_rows(str(dataset)), tok, args.num_samples, args.seq_len, args.seed)
    chunks_file = work / "chunks.json"
    chunks_file.write_text(json.dumps(samples.chunks))
    print(f"[1/4] {len(samples.chunks)} chunks x {args.seq_len} tokens -> {chunks_file}")

    lc_strategy = "attn_head" if args.strategy == "head" else "tensor"
    lc_out = work / f"lc-{args.strategy}"
    lc_wall = None
    if not (args.reuse_lc and lc_out.exists()):
        cmd = [
            args.lc_python,
            str(HERE / "lc_oneshot.py"),
            str(model_path),
            str(chunks_file),
            str(lc_out),
            "--strategy",
            lc_strategy,
        ]
        print("[2/4] " + " ".join(cmd))
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lc_wall = time.perf_counter() - t
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-3000:] + r.stderr[-5000:])
            raise SystemExit(f"llm-compressor run failed (exit {r.returncode})")
    lc = _lc_scales(lc_out)

    print("[3/4] qkv minmax, float32")
    t = time.perf_counter()
    cal = calibrate(
        args.model,
        samples=Samples(samples.chunks, samples.info),
        kv_cache_dtype="fp8",
        strategy=args.strategy,
        observer="minmax",
        dtype="float32",
    )
    qkv_wall = time.perf_counter() - t

    rows, worst = [], 0.0
    for r in cal.layers:
        cells = [str(r.layer)]
        for kind, mine in (("k", r.k_scale), ("v", r.v_scale)):
            theirs = lc[r.layer, kind]
            rel = ((mine - theirs).abs() / theirs).max().item()
            worst = max(worst, rel)
            cells += [f"{mine.max().item():.6g}", f"{theirs.max().item():.6g}", f"{100 * rel:.4f}%"]
        rows.append("| " + " | ".join(cells) + " |")
    head_note = " (per-head: largest head scale shown, diff is the worst head)" if args.strategy == "head" else ""
    text = "\n".join(
        [
            f"# qkv minmax vs llm-compressor static_minmax: {args.model}, fp8, {args.strategy}",
            "",
            f"Same {len(samples.chunks)} token chunks x {args.seq_len} tokens (WikiText-2 validation, "
            f"`wiki.valid.tokens`, qkv's packing, seed {args.seed}), model in float32 in both.",
            f"llm-compressor (llmcompressor, compressed-tensors, transformers, torch): {_lc_version(args.lc_python)}; "
            f"KV-only recipe, `observer: static_minmax`, pipeline `basic`.",
            "",
            f"Command: `python scripts/compare_llmcompressor.py --model {args.model} --num-samples "
            f"{args.num_samples} --seq-len {args.seq_len} --strategy {args.strategy}`",
            "",
            f"**Max per-layer relative difference: {100 * worst:.4f}%** (K and V, all {len(cal.layers)} layers)"
            + head_note,
            "",
            f"Wall time on this CPU (1 thread, shared machine): qkv {qkv_wall:.0f} s"
            + (f", llm-compressor {lc_wall:.0f} s (incl. start-up and save)" if lc_wall else ""),
            "",
            "| layer | K qkv | K llm-compressor | K rel diff | V qkv | V llm-compressor | V rel diff |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    out = Path(args.output)
    if out.exists() and args.strategy != "tensor":
        out = out.with_name(out.stem + f"_{args.strategy}" + out.suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[4/4] max relative difference {100 * worst:.4f}% -> {out}")
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
