"""Automatic skip-layer selection: the fewest layers kept in BF16 so that the model meets a ppl budget.

The kept layers hold the model's dtype (BF16), as vLLM's skipped layers do, or with ``skip_dtype`` a per-token
8-bit cache (``--kv-cache-dtype-skip-dtype int8_per_token_head``): a 4-bit cache's most sensitive layers then
cost half of BF16's bytes, and the search measures them as they will be served.

``qkv calibrate ... --auto-skip --max-ppl-delta 0.2%`` runs this after the scales
are chosen, on held-out calibration windows (chunks of the same dataset that
the scales never saw):

1. **Sensitivity.** One layer at a time is quantized with the new scales, every
   other layer stays BF16, and each window's logits are compared with the
   all-BF16 cache: the perplexity change and the mean per-token KL.
2. **Selection.** Layers are ranked by KL (most sensitive first; KL is never
   negative, so it ranks more stably than a small ppl change). For k = 0, 1, 2,
   ... the top k stay BF16 and all the others are quantized, and the *combined*
   ppl change is measured; the first k within the budget wins. Per-layer errors
   do not add up exactly, so the combination is measured, not estimated.
3. **Stopping.** By default (``stop="upper"``) a k is within the budget when the
   upper end of its change's 95 % interval is: a paired bootstrap over the
   held-out windows, the interval ``qkv eval`` reports. Stopping at the first k
   whose *point* estimate dips under the budget (``stop="point"``) selects for
   noise in its favour, so that estimate runs low exactly where the search stops,
   and unseen text then misses the budget (eval/results/README.md, 4-bit auto-skip).

Everything runs through the paged engine (write-then-attend), swapping the cache
layout between passes with :meth:`qkv.engine.LLMEngine.replace_kv_cache`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from tqdm.auto import tqdm

from qkv.layer_specs import build_layer_specs
from qkv.metrics import interval95, paired_bootstrap, token_metrics, token_nll
from qkv.model_loader import attention_layout
from qkv.scoring import prefill_logits

from .run import Calibration

__all__ = ["select_skip_layers", "plot_sensitivity", "kept_in", "FIGURE_FILE", "STOP_RULES"]

logger = logging.getLogger("qkv")
FIGURE_FILE = "sensitivity.png"
STOP_RULES = ("upper", "point")
N_BOOT = 2000  # qkv eval's default resamples, so the two report the same interval for the same windows


def _scales(cal: Calibration) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for r in cal.layers:
        k, v = r.k_scale.to(torch.float32), r.v_scale.to(torch.float32)
        if cal.strategy != "channel":
            k, v = k.reshape(-1), v.reshape(-1)
        out[r.layer] = (k, v)
    return out


class _Scorer:
    """Held-out windows through one engine, with the cache layout swapped per configuration."""

    def __init__(self, engine, cal: Calibration, windows: list[list[int]], skip_dtype: str = "auto") -> None:
        self.engine, self.cal, self.windows, self.skip_dtype = engine, cal, windows, skip_dtype
        self.layout = attention_layout(engine.model)
        self.all_layers = [d["layer_idx"] for d in self.layout]
        self.scales = _scales(cal)
        self.clips = {c.layer: (c.k_clip, c.v_clip) for c in cal.clips or []}
        self.base_nll: list[float] = []
        self.window_tokens = np.array([len(w) - 1 for w in windows], dtype=float)  # scored per window
        self.num_tokens = int(self.window_tokens.sum())

    def use(self, quantized: set[int], kept: bool = False) -> None:
        """``quantized`` layers in the calibrated dtype; the others in the model's dtype, or with ``kept`` in the
        dtype the kept layers will be served in (the search's passes; the baseline and the per-layer
        sensitivities are measured against BF16)."""
        skip = [i for i in self.all_layers if i not in quantized] or None
        specs = build_layer_specs(
            self.layout,
            self.cal.kv_dtype.name,
            self.engine.dtype,
            skip,
            self.cal.rotation,
            self.skip_dtype if kept else "auto",
        )
        self.engine.replace_kv_cache(
            specs,
            {i: s for i, s in self.scales.items() if i in quantized},
            {i: c for i, c in self.clips.items() if i in quantized},
            {i: b for i, b in (self.cal.bases or {}).items() if i in quantized},
        )

    def logits(self, ids: list[int]) -> torch.Tensor:
        return prefill_logits(self.engine, ids)[:-1]

    def nll(self, ids: list[int], logits: torch.Tensor | None = None) -> float:
        """Summed next-token NLL of one window (its logits computed unless given)."""
        logits = self.logits(ids) if logits is None else logits
        return float(token_nll(logits, _targets(ids)).sum())

    def ppl_delta(self, nll: float) -> float:
        base = sum(self.base_nll)
        return 100.0 * (math.exp((nll - base) / self.num_tokens) - 1.0)

    def interval(self, nlls: list[float]) -> list[float]:
        """95 % paired bootstrap interval of the ppl change from per-window NLL sums (seed 0: reproducible)."""
        den = self.window_tokens
        return interval95(paired_bootstrap(np.array(nlls), den, np.array(self.base_nll), den, N_BOOT, 0))


def select_skip_layers(
    engine,
    cal: Calibration,
    windows: list[list[int]],
    max_ppl_delta: float,
    progress: bool = True,
    stop: str = "upper",
    skip_dtype: str = "auto",
) -> dict:
    """Measure per-layer sensitivity on ``windows`` and choose the layers to keep; returns the record.

    ``engine`` must have an unquantized cache (calibration's own engine does) and
    be idle; its cache is left all-BF16 afterwards. ``stop`` is the rule of step 3
    of the module docstring: ``"upper"`` (the interval's upper end) or ``"point"``.
    ``skip_dtype``: what the kept layers hold (``"auto"``: the model's dtype), in
    every pass, so that the selection curve is the one the checkpoint will be served with.
    The per-layer sensitivities are measured against the all-BF16 cache either way.
    """
    if not windows:
        raise ValueError("--auto-skip needs held-out windows (--heldout-samples >= 1)")
    if stop not in STOP_RULES:
        raise ValueError(f"--auto-skip-stop: {stop!r} is not one of {', '.join(STOP_RULES)}")
    sc = _Scorer(engine, cal, windows, skip_dtype)
    n_layers = len(sc.all_layers)
    nll = {i: 0.0 for i in sc.all_layers}
    kl = {i: 0.0 for i in sc.all_layers}
    bar = tqdm(total=len(windows) * (n_layers + 1), desc="auto-skip", unit="pass", disable=not progress)
    for ids in windows:
        sc.use(set())
        base = sc.logits(ids)
        sc.base_nll.append(sc.nll(ids, base))
        bar.update(1)
        for i in sc.all_layers:
            sc.use({i})
            n, k, _ = token_metrics(base, sc.logits(ids), _targets(ids))
            nll[i] += float(n.sum())
            kl[i] += float(k.sum())
            bar.update(1)
    bar.close()
    layers = [
        {"layer": i, "ppl_delta_pct": sc.ppl_delta(nll[i]), "kl_mean": kl[i] / sc.num_tokens} for i in sc.all_layers
    ]
    ranking = [d["layer"] for d in sorted(layers, key=lambda d: (-d["kl_mean"], d["layer"]))]

    search = []
    chosen: list[int] = list(ranking)
    label = kept_in(skip_dtype)
    for k in range(n_layers + 1):
        keep = sorted(ranking[:k])
        if k == n_layers and skip_dtype == "auto":
            delta, ci = 0.0, [0.0, 0.0]  # every layer BF16: the baseline itself
        else:
            sc.use(set(sc.all_layers) - set(keep), kept=True)
            nlls = [sc.nll(w) for w in windows]
            delta, ci = sc.ppl_delta(sum(nlls)), sc.interval(nlls)
        search.append({"skip_layers": keep, "ppl_delta_pct": delta, "ppl_delta_pct_ci95": ci})
        logger.info("auto-skip: %d layer(s) in %s %s -> ppl %+.3f%% [%+.2f, %+.2f]", k, label, keep, delta, *ci)
        if (ci[1] if stop == "upper" else delta) <= max_ppl_delta:
            chosen = keep
            break
    else:  # only an 8-bit kept dtype can get here: with BF16 the last point is the baseline itself
        logger.warning(
            "auto-skip: even every layer in %s misses the %g%% budget; keeping them all", label, max_ppl_delta
        )
    sc.use(set())
    return {
        "max_ppl_delta_pct": max_ppl_delta,
        "stop": stop,
        "skip_dtype": skip_dtype,
        "interval": f"95 % paired bootstrap over the held-out windows, {N_BOOT} resamples, seed 0",
        "metric_for_ranking": "kl_mean",
        "heldout": {"windows": len(windows), "tokens": sc.num_tokens, "window_len": max(len(w) for w in windows)},
        "baseline_nll_per_token": sum(sc.base_nll) / sc.num_tokens,
        "layers": layers,
        "ranking": ranking,
        "search": search,
        "skip_layers": chosen,
        "ppl_delta_pct": search[-1]["ppl_delta_pct"],
        "ppl_delta_pct_ci95": search[-1]["ppl_delta_pct_ci95"],
    }


def kept_in(skip_dtype: str) -> str:
    """What the kept layers hold, for messages and the figure: BF16 (``"auto"``, the model's dtype; records made
    before ``skip_dtype`` existed have none) or the per-token 8-bit dtype."""
    return "BF16" if skip_dtype == "auto" else skip_dtype


def _targets(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids[1:], dtype=torch.long)


def plot_sensitivity(record: dict, title: str, path: str | Path) -> Path:
    """Per-layer KL and ppl change (kept layers highlighted) and the selection curve, as a PNG."""
    layers = record["layers"]
    keep = set(record["skip_layers"])
    kept = kept_in(record.get("skip_dtype", "auto"))
    idx = [d["layer"] for d in layers]
    colors = ["tab:red" if i in keep else "tab:blue" for i in idx]
    fig = Figure(figsize=(9, 9), constrained_layout=True)  # no pyplot: no global backend or figure state
    a1, a2, a3 = fig.subplots(3, 1)
    a1.bar(idx, [max(d["kl_mean"], 1e-9) for d in layers], color=colors)
    a1.set_yscale("log")
    a1.set_ylabel("mean KL (one layer quantized)")
    a1.set_title(f"{title}: red = kept in {kept} ({len(keep)} of {len(layers)})")
    a2.bar(idx, [d["ppl_delta_pct"] for d in layers], color=colors)
    a2.axhline(0, color="black", lw=0.5)
    a2.set_ylabel("ppl change % (one layer)")
    a2.set_xlabel("layer")
    ks = list(range(len(record["search"])))
    a3.plot(ks, [s["ppl_delta_pct"] for s in record["search"]], "o-")
    if all("ppl_delta_pct_ci95" in s for s in record["search"]):  # records before the interval have none
        a3.fill_between(
            ks,
            [s["ppl_delta_pct_ci95"][0] for s in record["search"]],
            [s["ppl_delta_pct_ci95"][1] for s in record["search"]],
            alpha=0.2,
            label=f"95 % interval (stop: {record['stop']})",
        )
    a3.axhline(record["max_ppl_delta_pct"], color="tab:red", ls="--", label="budget")
    a3.xaxis.set_major_locator(MaxNLocator(integer=True))  # a count of layers: no half-layer ticks
    a3.set_xlabel(f"layers kept in {kept} (most sensitive first)")
    a3.set_ylabel("ppl change % (all others quantized)")
    a3.legend()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
