"""Check that qkv's minmax fp8 scales agree with llm-compressor's ``static_minmax`` on identical data.

    python -m qkv.calibrate.compare_llmcompressor [--model smollm2-135m] [--num-samples 128]
        [--seq-len 512] [--strategy tensor] [--lc-python /tmp/lc-venv/bin/python]

1. draws the token chunks with qkv's own data pipeline (WikiText-2 validation,
   seed 0) and dumps them to ``WORKDIR/chunks.json``;
2. runs llm-compressor in its own virtual environment (``--lc-python``; set it up
   with ``python3 -m venv /tmp/lc-venv && /tmp/lc-venv/bin/pip install torch==2.13.0
   && /tmp/lc-venv/bin/pip install llmcompressor``) through ``calibrate/lc_oneshot.py``:
   float32 model, KV-only recipe with ``observer: static_minmax``;
3. runs qkv's minmax observer on the same chunks with the model in float32;
4. writes a per-layer table (scales and relative differences) to
   ``calibrate/results/llmcompressor_agreement.md``.

Only the table is meant to be committed; llm-compressor's checkpoint stays in WORKDIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"


def _lc_scales(out: Path) -> dict[tuple[int, str], torch.Tensor]:
    import re
    name = re.compile(r"layers\.(\d+)\.self_attn\.(k|v)_scale$")
    scales = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():
                m = name.search(n)
                if m:
                    scales[int(m.group(1)), m.group(2)] = fh.get_tensor(n).float().reshape(-1)
    if not scales:
        raise SystemExit(f"no k_scale/v_scale tensors in {out}")
    return scales


def _lc_version(lc_python: str) -> str:
    r = subprocess.run([lc_python, "-c", "import importlib.metadata as m; print(m.version('llmcompressor'), "
                        "m.version('compressed-tensors'), m.version('transformers'), m.version('torch'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", choices=["tensor", "head"], default="tensor")
    ap.add_argument("--lc-python", default="/tmp/lc-venv/bin/python")
    ap.add_argument("--workdir", default="/tmp/qkv-lc-compare")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both runs (default 1)")
    ap.add_argument("--reuse-lc", action="store_true", help="reuse llm-compressor's output in WORKDIR")
    ap.add_argument("--output", default=str(HERE / "results" / "llmcompressor_agreement.md"))
    args = ap.parse_args(argv)

    from qkv.registry import resolve_model

    from .data import Samples, build_samples, load_rows
    from .run import calibrate

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_path))
    samples = build_samples(load_rows(args.dataset), tok, args.num_samples, args.seq_len, args.seed)
    chunks_file = work / "chunks.json"
    chunks_file.write_text(json.dumps(samples.chunks))
    print(f"[1/4] {len(samples.chunks)} chunks x {args.seq_len} tokens -> {chunks_file}")

    lc_strategy = "attn_head" if args.strategy == "head" else "tensor"
    lc_out = work / f"lc-{args.strategy}"
    lc_wall = None
    if not (args.reuse_lc and lc_out.exists()):
        cmd = [args.lc_python, str(HERE / "lc_oneshot.py"), str(model_path), str(chunks_file), str(lc_out),
               "--strategy", lc_strategy]
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
    cal = calibrate(args.model, samples=Samples(samples.chunks, samples.info), kv_cache_dtype="fp8",
                    strategy=args.strategy, observer="minmax", dtype="float32")
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
    text = "\n".join([
        f"# qkv minmax vs llm-compressor static_minmax: {args.model}, fp8, {args.strategy}",
        "",
        f"Same {len(samples.chunks)} token chunks x {args.seq_len} tokens (WikiText-2 validation, "
        f"`wiki.valid.tokens`, qkv's packing, seed {args.seed}), model in float32 in both.",
        f"llm-compressor (llmcompressor, compressed-tensors, transformers, torch): {_lc_version(args.lc_python)}; "
        f"KV-only recipe, `observer: static_minmax`, pipeline `basic`.",
        "",
        f"Command: `python -m qkv.calibrate.compare_llmcompressor --model {args.model} --num-samples "
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
        *rows, ""])
    out = Path(args.output)
    if out.exists() and args.strategy != "tensor":
        out = out.with_name(out.stem + f"_{args.strategy}" + out.suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[4/4] max relative difference {100 * worst:.4f}% -> {out}")
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
