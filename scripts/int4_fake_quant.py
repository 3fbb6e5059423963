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

``--set k8v4`` runs the rules that might take k8v4 (K int8, V int4) from its fake-quant +0.5-0.8 % to
issue 25's +0.7 % with a margin, none of which needs a new cache layout: each side alone (16 bits: that side
unquantized), the clipping ratio on a finer grid, llama.cpp q4_0's ``signed`` grid (the row's signed extreme
maps to -8, so all 16 codes are used), a per-token ``search`` for the ratio of least round-trip error (what a
write kernel could do), and the first token's V left unquantized (``sink_v``). ``--set asym`` runs vLLM
0.32's ``int4_per_token_head`` rule (16 levels over each row's [min, max] with a zero point, after a
randomized Hadamard transform) on V and on both sides, against qkv's symmetric grid.

Usage: ``.venv/bin/python scripts/int4_fake_quant.py -o eval/results/smollm2-4bit/fake_quant.json``
(about 8 minutes on 2 cores at 16 windows), ``--set k8v4,asym -o
eval/results/smollm2-4bit/fake_quant_k8v4.json`` (about 30). Nothing here is imported by qkv; the uniform rows
call the product's rule (``qkv.kernels.quant``).
"""

from __future__ import annotations

import argparse
import functools
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
    k_bits: int = 4  # 16: that side is not quantized
    v_bits: int = 4
    rotate: bool = True
    clip: float = 1.0
    center_k: bool = False
    group: int = 0  # channels per scale; 0: one scale per token and head
    nf4: bool = False
    sink: int = 0
    # a 4-bit side's codes: "uniform" [-7, 7] (qkv's earlier rule), "signed" [-8, 7] (the product's now),
    # "search" (ratio per token), "asym" (vLLM's)
    grid: str = "uniform"
    rht: bool = False  # random signs before the Hadamard rotation (vLLM's RHT), undone after it
    sink_v: int = 0  # the first tokens' V left unquantized (K quantized)


SEARCH_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)

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

K8V4_RULES = [
    Rule("k8v4 rotated", k_bits=8),
    Rule("k8v4 rotated clip", k_bits=8, clip=0.925),
    Rule("k8 only, rotated", k_bits=8, v_bits=16),
    Rule("v4 only, rotated clip", k_bits=16, clip=0.925),
    *[Rule(f"k8v4 rotated clip {r}", k_bits=8, clip=r) for r in (0.9, 0.94, 0.95, 0.96, 0.975)],
    Rule("k8v4 rotated signed", k_bits=8, grid="signed"),
    Rule("k8v4 rotated signed clip 0.95", k_bits=8, clip=0.95, grid="signed"),
    Rule("k8v4 rotated search", k_bits=8, grid="search"),
    Rule("k8v4 rotated signed search", k_bits=8, grid="signed-search"),
    Rule("k8v4 rotated clip sink-v1", k_bits=8, clip=0.925, sink_v=1),
    Rule("k8v4 rotated clip sink-v4", k_bits=8, clip=0.925, sink_v=4),
]

# vLLM 0.32's int4_per_token_head rule (asymmetric, randomized Hadamard) against qkv's symmetric one
ASYM_RULES = [
    Rule("k8v4 rotated asym", k_bits=8, grid="asym"),
    Rule("k8v4 rht asym", k_bits=8, grid="asym", rht=True),
    Rule("int4 rotated asym", grid="asym"),
    Rule("int4 rht asym", grid="asym", rht=True),
    Rule("int4 rht", rht=True),
]
# the three V grids of k8v4 at calibration's ratio, to repeat on other windows
GRID_RULES = [
    r for r in K8V4_RULES + ASYM_RULES if r.name in ("k8v4 rotated clip", "k8v4 rotated signed", "k8v4 rotated asym")
]
# the signed grid on both sides of int4, against the symmetric one at the same ratios
INT4_SIGNED_RULES = [
    Rule("int4 rotated signed", grid="signed"),
    Rule("int4 rotated signed clip 0.925", clip=0.925, grid="signed"),
]
SETS = {
    "int4": RULES,
    "k8v4": K8V4_RULES,
    "asym": ASYM_RULES,
    "grids": GRID_RULES,
    "int4-signed": INT4_SIGNED_RULES,
}


def asym_grid(x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's ``int4_per_token_head`` round trip: 16 levels over the row's [min, max], an integer
    zero point in [0, 15], both rounded half away from zero, and the zero point kept in the fp32 scale's
    low 4 mantissa bits (so the scale loses them)."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-6)

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t >= 0, torch.floor(t + 0.5), torch.ceil(t - 0.5))

    zp = rnd(-lo / scale).clamp(0, 15)
    q = rnd(x * (1.0 / scale) + zp).clamp(0, 15)
    kept = (scale.view(torch.int32) & -16).view(torch.float32)
    return (q - zp) * kept


def symmetric_grid(x: torch.Tensor, clip: float) -> torch.Tensor:
    """qkv's int4 rule before the signed grid (the rows named "uniform"): ``scale = amax / 7 * clip``, floored,
    codes in [-7, 7], in the product's fp32 order."""
    s = x.abs().amax(-1, keepdim=True) / 7.0
    if clip != 1.0:
        s = s * torch.tensor(clip, dtype=torch.float32)
    s = s.clamp(min=DYNAMIC_SCALE_FLOOR)
    return torch.round(x / s).clamp(-7, 7) * s


def signed_grid(x: torch.Tensor, clip: float) -> torch.Tensor:
    """q4_0's grid: ``scale = x[argmax |x|] / -8 * clip``, codes in [-8, 7] (the extreme one lands on -8)."""
    m = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
    s = m / -8.0 * clip
    s = torch.where(s.abs() < DYNAMIC_SCALE_FLOOR, torch.full_like(s, DYNAMIC_SCALE_FLOOR), s)
    return torch.round(x / s).clamp(-8, 7) * s


def per_token_search(x: torch.Tensor, quant) -> torch.Tensor:
    """Each row's round trip by the ratio of :data:`SEARCH_RATIOS` with the least squared error."""
    best = quant(x, SEARCH_RATIOS[0])
    err = ((best - x) ** 2).sum(-1, keepdim=True)
    for r in SEARCH_RATIOS[1:]:
        y = quant(x, r)
        e = ((y - x) ** 2).sum(-1, keepdim=True)
        better = e < err
        best, err = torch.where(better, y, best), torch.where(better, e, err)
    return best


def fake_quant(x: torch.Tensor, side: int, rule: Rule) -> torch.Tensor:
    """Quantize and dequantize one side (0 K, 1 V) of ``x`` [..., D] along its last dim by ``rule``.

    An 8-bit side is the product's rule (``qkv.kernels.quant``'s per-token scales and rounding). A 4-bit side's
    "uniform" grid is qkv's symmetric [-7, 7] rule from before the product took the signed grid (so the committed
    rows stay reproducible), "signed" the product's rule now; either applies per group of channels when
    ``rule.group`` is set. ``clip`` applies to a 4-bit side only, as calibration's ratios do.
    """
    bits = rule.k_bits if side == 0 else rule.v_bits
    if bits == 16:
        return x
    dt = resolve_cache_dtype("int4_per_token_head" if rule.k_bits == 4 else "k8v4_per_token_head")
    clip = rule.clip if bits == 4 else 1.0
    shape = x.shape
    if rule.group:
        x = x.reshape(*shape[:-1], shape[-1] // rule.group, rule.group)

    def product(t: torch.Tensor, r: float) -> torch.Tensor:
        scale = dynamic_scales(t, dt, side, r)
        return dequantize(quantize(t, scale, dt, side), scale, dt, torch.float32)

    if bits == 4 and rule.nf4:
        s = x.abs().amax(-1, keepdim=True).clamp(min=DYNAMIC_SCALE_FLOOR) * clip
        y = NF4[((x / s).clamp(-1, 1)[..., None] - NF4).abs().argmin(-1)] * s
    elif bits == 4 and rule.grid == "asym":
        y = asym_grid(x)
    elif bits == 4:
        quant = signed_grid if rule.grid.startswith("signed") else symmetric_grid
        y = per_token_search(x, quant) if rule.grid.endswith("search") else quant(x, clip)
    else:
        y = product(x, clip)
    return y.reshape(shape)


@functools.cache
def rht_signs(d: int) -> torch.Tensor:
    """A fixed random +-1 vector (the D of a randomized Hadamard transform ``H D``)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (d,), generator=gen).to(torch.float32) * 2 - 1


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
            if rule.rht:
                signs = rht_signs(k.shape[-1])
                kq = rot(fake_quant(rot(k * signs), 0, rule)) * signs  # (H D)^-1 = D H
                vq = rot(fake_quant(rot(v * signs), 1, rule)) * signs
            else:
                kq = rot(fake_quant(rot(k), 0, rule))  # H = H^T = H^-1
                vq = rot(fake_quant(rot(v), 1, rule))
            if rule.center_k:
                kq = kq + self.k_mean[layer][None, :, None, :]
            if rule.sink:
                kq[:, :, : rule.sink], vq[:, :, : rule.sink] = k0[:, :, : rule.sink], v0[:, :, : rule.sink]
            if rule.sink_v:
                vq[:, :, : rule.sink_v] = v0[:, :, : rule.sink_v]
            k, v = kq, vq
        return sdpa_attention_forward(module, q, k, v, mask, **kw)


def score(
    model, windows: list[torch.Tensor], base: list[torch.Tensor] | None = None, keep: list[torch.Tensor] | None = None
) -> tuple[float, float, float]:
    """Perplexity over ``windows``, and the mean and largest per-token KL(base || this) against the
    unquantized log-probabilities ``base`` (0.0 without them); ``keep`` collects this run's log-probabilities.

    KL ranks rules more steadily than a ppl change of a few tenths, whose sign follows how the rounding
    errors fall on the few tokens that dominate the NLL.
    """
    nll, n, kl_sum, kl_max = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for i, x in enumerate(windows):
            logp = torch.log_softmax(model(x[None]).logits[0, :-1].float(), dim=-1)
            nll -= float(logp.gather(-1, x[1:, None]).sum())
            n += len(x) - 1
            if keep is not None:
                keep.append(logp)
            if base is not None:
                kl = (base[i].exp() * (base[i] - logp)).sum(-1)
                kl_sum, kl_max = kl_sum + float(kl.sum()), max(kl_max, float(kl.max()))
    return math.exp(nll / n), kl_sum / n, kl_max


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--first-window", type=int, default=0, help="skip this many windows of the test split")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--center-samples", type=int, default=16, help="validation windows of 512 for K's mean")
    ap.add_argument("--set", default="int4", help=f"which rules to run, comma-separated: {', '.join(SETS)}")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    if unknown := set(args.set.split(",")) - set(SETS):
        ap.error(f"--set: unknown rule sets {sorted(unknown)}; choose from {', '.join(SETS)}")

    path = model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    hook = Hook()
    AttentionInterface.register("qkv_fake_quant", hook)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="qkv_fake_quant")
    model.eval()

    def ids(split: str) -> torch.Tensor:
        return torch.tensor(tok(load_text(split).text, add_special_tokens=False)["input_ids"])

    test = ids("wikitext")
    first = args.first_window
    windows = [test[i * args.window : (i + 1) * args.window] for i in range(first, first + args.windows)]
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

    base_logp: list[torch.Tensor] = []
    base, _, _ = score(model, windows, keep=base_logp)
    print(f"{'no quantization':32s} ppl {base:.4f}", flush=True)
    rows = []
    for rule in [r for name in args.set.split(",") for r in SETS[name]]:
        hook.rule = rule
        t = time.time()
        ppl, kl, kl_max = score(model, windows, base_logp)
        rows.append(
            {**asdict(rule), "ppl": ppl, "delta_pct": 100 * (ppl / base - 1), "kl_mean": kl, "kl_max": kl_max}
            | {"seconds": time.time() - t}
        )
        print(f"{rule.name:32s} ppl {ppl:.4f}  {rows[-1]['delta_pct']:+.2f} %  KL {kl:.5f}", flush=True)
    report = {
        "model": args.model,
        "set": args.set,
        "windows": f"{args.windows} x {args.window} WikiText-2 test tokens from window {first}, no BOS, fp32",
        "k_mean": f"{args.center_samples} x 512 WikiText-2 validation tokens",
        "base_ppl": base,
        "rows": rows,
        "machine": cpu_info(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
