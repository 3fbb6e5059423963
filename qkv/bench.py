"""``qkv bench``: TTFT and decode throughput of qkv and ``transformers.generate``, side by side.

Both run in this process on the same weights, dtype and token ids, and the
measurements are interleaved (qkv, then transformers, per repeat) so machine
noise hits both alike. Results go to a JSON file; the README quotes its ratios.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

__all__ = ["run_bench", "random_prompts"]


def random_prompts(vocab: int, n: int, length: int, seed: int, avoid: set[int]) -> list[list[int]]:
    """``n`` reproducible random prompts of ``length`` ids, with ``avoid`` (EOS) ids replaced."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append([t if t not in avoid else 3 for t in ids])
    return out


def _qkv_run(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds until every prompt has ``max_tokens`` tokens."""
    from .sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    left = {engine.add_request(p, params) for p in prompts}
    while left:
        for out in engine.step():
            if out.finished:
                left.discard(out.request_id)
    return time.perf_counter() - t0


def _hf_run(model, prompts: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def run_bench(args) -> dict:
    from transformers import AutoModelForCausalLM

    from .cli import engine_kwargs
    from .llm import LLM

    kwargs = engine_kwargs(args)
    kwargs["enable_prefix_caching"] = False  # every repeat must compute its prompt
    llm = LLM(args.model, **kwargs)
    engine = llm.llm_engine
    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path), dtype=engine.dtype,
                                              attn_implementation="sdpa").to(engine.device).eval()
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    L, N = args.prompt_len, args.output_len
    results: dict = {"ttft_ms": {}, "decode_tokens_per_s": {}}
    seed = 0
    for b in batch_sizes:
        q_ttft, h_ttft, q_dec, h_dec = [], [], [], []
        for r in range(args.repeats + 1):  # the first round warms both up and is discarded
            seed += 1
            prompts = random_prompts(engine.vocab_size, b, L, seed, engine.eos_token_ids)
            # TTFT of a batch = time until every prompt has its first token (the whole prefill);
            # decode rate = tokens after the first over the extra time of an N-token run.
            q_first = _qkv_run(engine, prompts, 1)
            h_first = _hf_run(hf, prompts, 1)
            q_total = _qkv_run(engine, prompts, N)
            h_total = _hf_run(hf, prompts, N)
            if r == 0:
                continue
            q_ttft.append(q_first)
            h_ttft.append(h_first)
            q_dec.append(b * (N - 1) / max(q_total - q_first, 1e-9))
            h_dec.append(b * (N - 1) / max(h_total - h_first, 1e-9))
        qt, ht = statistics.median(q_ttft) * 1000, statistics.median(h_ttft) * 1000
        qd, hd = statistics.median(q_dec), statistics.median(h_dec)
        results["ttft_ms"][f"batch_{b}"] = {"qkv": qt, "transformers": ht, "qkv_over_transformers": qt / ht}
        results["decode_tokens_per_s"][f"batch_{b}"] = {"qkv": qd, "transformers": hd,
                                                         "qkv_over_transformers": qd / hd}
    report = {
        "model": args.model, "dtype": str(engine.dtype).replace("torch.", ""),
        "kv_cache_dtype": args.kv_cache_dtype, "device": str(engine.device),
        "attention_backend": type(engine.backend).__name__,
        "prompt_len": L, "output_len": N, "repeats": args.repeats, "results": results,
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return report
