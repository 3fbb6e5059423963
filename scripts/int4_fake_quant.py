"""What 4-bit K/V rules are worth on SmolLM2, before anyone builds one: a fake-quant reference.

Issue 25's table was made this way: transformers in fp32, K (after RoPE) and V quantized and
dequantized inside attention, perplexity on the first 8 x 1,024 WikiText-2 test tokens (no BOS).
This script makes that table again and adds the rules that might close the gap to its +4 % target,
each alone and together, so that the lab notes can say with numbers what each buys:

* ``clip``: each token's absmax times a ratio (0.925, what ``qkv calibrate`` chose for every
  rotated int4 layer);
* ``center``: subtract a static mean of post-RoPE K per layer, kv head and channel (taken over
  validation tokens) before rotating; softmax ignores a per-query constant, so attention is unchanged
  in exact arithmetic and only the quantization error moves;
* ``group``: one scale per group of channels instead of one per token and head (two scales at 32);
* ``nf4``: the 16 NormalFloat levels instead of the uniform int4 grid (rotated rows are near-Gaussian);
* ``sink``: the first tokens of every window left unquantized (attention sinks).

Usage: ``.venv/bin/python scripts/int4_fake_quant.py -o eval/results/smollm2-4bit/fake_quant.json``
(about 8 minutes on 2 cores at 16 windows). Nothing here is imported by qkv; the uniform rows call the product's rule
(``qkv.kernels.quant``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from qkv.eval.data import load_text, wikitext_valid_file
from qkv.eval.machine import cpu_info
from qkv.kernels.quant import (
    DYNAMIC_SCALE_FLOOR,
    dequantize,
    dynamic_scales,
    hadamard_rotate,
    quantize,
    resolve_cache_dtype,
)
from qkv.pull import model_dir

# bitsandbytes' NF4 levels (quantiles of N(0, 1) scaled to [-1, 1]), the usual 4-bit codebook for Gaussian rows
NF4 = torch.tensor(
    [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0]
    + [0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]
)


@dataclass(frozen=True)
class Rule:
    name: str
    k_bits: int = 4
    v_bits: int = 4
    rotate: bool = True
    clip: float = 1.0
    center_k: bool = False
    group: int = 0  # channels per scale; 0: one scale per token and head
    nf4: bool = False
    sink: int = 0


RULES = [
    Rule("int4", rotate=False),
    Rule("int4 rotated"),
    Rule("int4 rotated clip", clip=0.925),
    Rule("int4 rotated clip center-K", clip=0.925, center_k=True),
    Rule("int4 rotated clip group32", clip=0.925, group=32),
    Rule("int4 rotated nf4", nf4=True),
    Rule("int4 rotated clip sink16", clip=0.925, sink=16),
    Rule("int4 rotated clip center-K group32", clip=0.925, center_k=True, group=32),
    Rule("int4 rotated nf4 center-K", center_k=True, nf4=True),
    Rule("int4 rotated nf4 center-K group32", center_k=True, group=32, nf4=True),
    Rule("int4 rotated all", clip=0.925, center_k=True, group=32, nf4=True, sink=16),
    Rule("k8v4 rotated", k_bits=8),
    Rule("k8v4 rotated clip", k_bits=8, clip=0.925),
]


def fake_quant(x: torch.Tensor, side: int, rule: Rule) -> torch.Tensor:
    """Quantize and dequantize one side (0 K, 1 V) of ``x`` [..., D] along its last dim by ``rule``.

    The uniform grid is the product's rule (``qkv.kernels.quant``'s per-token scales and rounding), applied per
    group of channels when ``rule.group`` is set; ``clip`` applies to a 4-bit side only, as calibration's ratios do.
    """
    bits = rule.k_bits if side == 0 else rule.v_bits
    dt = resolve_cache_dtype("int4_per_token_head" if rule.k_bits == 4 else "k8v4_per_token_head")
    clip = rule.clip if bits == 4 else 1.0
    shape = x.shape
    if rule.group:
        x = x.reshape(*shape[:-1], shape[-1] // rule.group, rule.group)
    if bits == 4 and rule.nf4:
        s = x.abs().amax(-1, keepdim=True).clamp(min=DYNAMIC_SCALE_FLOOR) * clip
        y = NF4[((x / s).clamp(-1, 1)[..., None] - NF4).abs().argmin(-1)] * s
    else:
        scale = dynamic_scales(x, dt, side, clip)
        y = dequantize(quantize(x, scale, dt, side), scale, dt, torch.float32)
    return y.reshape(shape)


class Hook:
    """The attention function transformers calls: K and V [B, H, T, D] after RoPE, before SDPA."""

    def __init__(self) -> None:
        self.rule: Rule | None = None
        self.k_mean: dict[int, torch.Tensor] = {}
        self.collect: dict[int, list[torch.Tensor]] | None = None

    def __call__(self, module, q, k, v, mask, **kw):
        layer = module.layer_idx
        if self.collect is not None:
            self.collect.setdefault(layer, []).append(k[0].mean(1))  # [H, D]
        rule = self.rule
        if rule is not None:
            k0, v0 = k, v
            if rule.center_k:
                k = k - self.k_mean[layer][None, :, None, :]
            rot = hadamard_rotate if rule.rotate else (lambda t: t)
            kq = rot(fake_quant(rot(k), 0, rule))  # H = H^T = H^-1
            vq = rot(fake_quant(rot(v), 1, rule))
            if rule.center_k:
                kq = kq + self.k_mean[layer][None, :, None, :]
            if rule.sink:
                kq[:, :, : rule.sink], vq[:, :, : rule.sink] = k0[:, :, : rule.sink], v0[:, :, : rule.sink]
            k, v = kq, vq
        return sdpa_attention_forward(module, q, k, v, mask, **kw)


def perplexity(model, windows: list[torch.Tensor]) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for x in windows:
            nll += model(x[None], labels=x[None]).loss.item() * (len(x) - 1)
            n += len(x) - 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--center-samples", type=int, default=16, help="validation windows of 512 for K's mean")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()

    path = model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    hook = Hook()
    AttentionInterface.register("qkv_fake_quant", hook)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="qkv_fake_quant")
    model.eval()

    def ids(split: str) -> torch.Tensor:
        return torch.tensor(tok(load_text(split).text, add_special_tokens=False)["input_ids"])

    test = ids("wikitext")
    windows = [test[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
    valid_file = wikitext_valid_file()
    if valid_file is None:
        raise SystemExit("WikiText-2's validation split is not found (K's mean is taken over it)")
    valid = ids(str(valid_file))
    hook.collect = {}
    with torch.no_grad():
        for i in range(args.center_samples):
            model(valid[i * 512 : (i + 1) * 512][None])
    hook.k_mean = {layer: torch.stack(ms).mean(0) for layer, ms in hook.collect.items()}
    hook.collect = None

    base = perplexity(model, windows)
    print(f"{'no quantization':32s} ppl {base:.4f}", flush=True)
    rows = []
    for rule in RULES:
        hook.rule = rule
        t = time.time()
        ppl = perplexity(model, windows)
        rows.append({**asdict(rule), "ppl": ppl, "delta_pct": 100 * (ppl / base - 1), "seconds": time.time() - t})
        print(f"{rule.name:32s} ppl {ppl:.4f}  {rows[-1]['delta_pct']:+.2f} %", flush=True)
    report = {
        "model": args.model,
        "windows": f"first {args.windows} x {args.window} WikiText-2 test tokens, no BOS, fp32",
        "k_mean": f"{args.center_samples} x 512 WikiText-2 validation tokens",
        "base_ppl": base,
        "rows": rows,
        "machine": cpu_info(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
