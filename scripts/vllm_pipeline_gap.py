"""Is vLLM's pipeline-parallel perplexity gap the checkpoint's or vLLM's? One process against two stages.

    .venv/bin/python scripts/vllm_pipeline_gap.py [--model DIR] [--dtype bfloat16|float32] [--kv auto|fp8]

The windows of tests/vllm (the first 4 x 512 WikiText-2 test tokens, no BOS), scored by vLLM's prompt
logprobs in one process and in two pipeline stages (one core each), both compiled. With the plain model and
a bf16 cache there are no scales at all, so whatever gap it prints is vLLM's own.
"""

from __future__ import annotations

import argparse
import math

from qkv.data_files import WIKITEXT_TEST, find_data_file
from qkv.eval.vllm_engine import VllmEngine
from qkv.model_loader import load_tokenizer
from qkv.registry import resolve_model

WINDOWS, WINDOW, KV_BYTES = 4, 512, 256 << 20


def _ppl(token_logprobs: list[list[float]]) -> float:
    return math.exp(-sum(map(sum, token_logprobs)) / sum(map(len, token_logprobs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the pulled smollm2-135m)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv", default="auto", help="vLLM's kv_cache_dtype")
    args = ap.parse_args()
    model = str(args.model or resolve_model("smollm2-135m"))
    text = find_data_file(WIKITEXT_TEST).read_text(encoding="utf-8")[:200_000]
    ids = load_tokenizer(model)(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(WINDOWS)]
    spec = {"model": model, "kv_cache_dtype": args.kv, "kv_bytes": KV_BYTES, "max_model_len": 1024}
    spec["dtype"] = args.dtype
    with VllmEngine(spec) as one:
        a = _ppl(one.prompt_logprobs(windows)[0])
    with VllmEngine({**spec, "pipeline_parallel_size": 2, "kv_bytes": KV_BYTES // 2}) as two:
        b = _ppl(two.prompt_logprobs(windows)[0])
    print(f"{model} {args.dtype}, kv {args.kv}: one process {a:.5f}, two stages {b:.5f} ({100 * (b / a - 1):+.3f} %)")


if __name__ == "__main__":
    main()
