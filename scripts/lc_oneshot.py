"""Run llm-compressor's KV-cache calibration on given token chunks (helper of compare_llmcompressor.py).

This file runs inside a separate virtual environment that has ``llmcompressor``
installed, and imports nothing of qkv (see scripts/README.md):

    $QKV_LC_PYTHON scripts/lc_oneshot.py MODEL CHUNKS.json OUT --strategy tensor

It loads MODEL in float32, feeds the pre-tokenized chunks unchanged (no
shuffling effect on a min/max, batch size 1), applies a KV-only recipe
(``kv_cache_scheme`` fp8, static, symmetric, ``observer: static_minmax``) and
saves the compressed-tensors checkpoint to OUT.
"""

import argparse
import json
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("chunks")
    ap.add_argument("out")
    ap.add_argument("--strategy", default="tensor", choices=["tensor", "attn_head"])
    ap.add_argument("--observer", default="static_minmax")
    args = ap.parse_args()
    with open(args.chunks) as f:
        chunks = json.load(f)
    ds = Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks]})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    recipe = QuantizationModifier(
        kv_cache_scheme={
            "num_bits": 8,
            "type": "float",
            "strategy": args.strategy,
            "dynamic": False,
            "symmetric": True,
            "observer": args.observer,
        }
    )
    t0 = time.perf_counter()
    oneshot(
        model=model,
        processor=tok,
        dataset=ds,
        recipe=recipe,
        num_calibration_samples=len(chunks),
        max_seq_length=max(len(c) for c in chunks),
        pipeline="basic",
        output_dir=args.out,
    )
    print(json.dumps({"llmcompressor_wall_s": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__":
    main()
