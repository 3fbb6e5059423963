"""How many K/V values static scales clip on evaluation text: ``python -m qkv.eval.saturation``.

    python -m qkv.eval.saturation MODEL --scales FILE_OR_DIR [...] [--num-windows 16]
        [--window 1024] [--split-at 512] -o OUT.json

The model runs over the same windows ``qkv eval`` scores, with an unquantized
cache; an observer sees exactly the K/V the cache would store. For every
scales source (in its own basis: rotated when it was calibrated with rotation)
it counts the values with ``|x| / scale > qmax``, which a static cache saturates
(fp8) or clamps (int8), for K and V, and how many of them sit at positions at or
past ``--split-at`` (say, the calibration sample length: RoPE turns K's channel
pairs with position, so per-channel scales can miss positions never observed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from qkv.kernels.quant import hadamard_rotate
from qkv.llm import LLM
from qkv.scales import KVScales, read_kv_scales
from qkv.scoring import prefill_logits

from . import data

__all__ = ["count_saturation", "main"]


def _shaped(scales: KVScales, layer: int, which: str, num_heads: int, head_dim: int) -> torch.Tensor:
    t = (scales.k if which == "k" else scales.v)[layer].to(torch.float32)
    return t.reshape(num_heads, head_dim) if scales.strategy == "channel" else t.reshape(-1, 1).expand(num_heads, 1)


def count_saturation(engine, windows: list[list[int]], sources: dict[str, KVScales], split_at: int) -> dict:
    """``{name: {"k": n, "v": n, "k_at_or_past_split": n, "v_at_or_past_split": n}}`` plus the total."""
    counts = {name: dict.fromkeys(("k", "v", "k_at_or_past_split", "v_at_or_past_split"), 0) for name in sources}
    total = [0]

    def observer(layer: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor) -> None:
        heads, dim = key.shape[1], key.shape[2]
        past = torch.arange(key.shape[0]) >= split_at  # one prefill chunk per window: row = position
        for name, sc in sources.items():
            # 1e-6 of slack: amax / (amax / qmax) can round a hair above qmax, which clips nothing
            qmax = (127.0 if sc.kind == "int" else 448.0) * (1 + 1e-6)
            for which, x in (("k", key), ("v", value)):
                x = hadamard_rotate(x) if sc.rotation else x.to(torch.float32)
                over = (x.abs() / _shaped(sc, layer, which, heads, dim)) > qmax
                counts[name][which] += int(over.sum())
                counts[name][f"{which}_at_or_past_split"] += int(over[past].sum())
        total[0] += key.numel()

    for ids in windows:
        prefill_logits(engine, ids, observer=observer, keep_logits=False, chunk_size=len(ids))
    return {"values_per_tensor": total[0], "split_at": split_at, "sources": counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--scales", nargs="+", required=True, help="scales files or calibrated checkpoint dirs")
    p.add_argument("--dataset", default="wikitext")
    p.add_argument("--num-windows", type=int, default=16)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--split-at", type=int, default=512)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    sources = {}
    for s in args.scales:
        sc = read_kv_scales(s)
        if sc is None:
            raise SystemExit(f"{s}: no k_scale/v_scale tensors")
        sources[s] = sc
    engine = LLM(args.model, kv_cache_dtype="auto", kv_cache_memory="64MiB").llm_engine
    windows = data.make_windows(engine.tokenizer, data.load_text(args.dataset).text, args.num_windows, args.window)
    result = {
        "model": args.model,
        "dataset": args.dataset,
        "num_windows": args.num_windows,
        "window": args.window,
        **count_saturation(engine, windows, sources, args.split_at),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
