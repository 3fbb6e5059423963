"""Perplexity, KL from the baseline and top-1 agreement, each window prefilled through the engine.

Every window is scored by :func:`qkv.scoring.prefill_logits` (write-then-attend
through each configuration's paged cache) and compared token by token with
:func:`qkv.metrics.token_metrics` (NLL, KL from the baseline, top-1 agreement);
perplexity is ``exp(sum nll / n)`` over all windows, KL is reported as mean and p99.

The perplexity delta carries a paired bootstrap confidence interval: windows are
resampled with replacement, the same resample for the baseline and the
configuration, and the delta's 2.5/97.5 percentiles are reported.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from qkv.metrics import interval95, paired_bootstrap, token_metrics
from qkv.scoring import prefill_logits

__all__ = ["ConfigTokens", "score_windows", "summarize", "paired_bootstrap"]

logger = logging.getLogger("qkv.eval")


@dataclass
class ConfigTokens:
    """What one configuration accumulated over the windows (per window, and every token's KL)."""

    nll_sum: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    kl_sum: list[float] = field(default_factory=list)
    top1_sum: list[int] = field(default_factory=list)
    kl_tokens: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0


def score_windows(
    engines: dict, windows: list[list[int]], baseline: str, chunk_size: int | None = None
) -> dict[str, ConfigTokens]:
    """Score every window with every engine (baseline first, then the others, window by window)."""
    out = {label: ConfigTokens() for label in engines}
    order = [baseline] + [k for k in engines if k != baseline]
    for w, ids in enumerate(windows):
        targets = torch.tensor(ids[1:], dtype=torch.long)
        base = None
        for label in order:
            t0 = time.perf_counter()
            logits = prefill_logits(engines[label], ids, chunk_size=chunk_size)[:-1]
            if not torch.isfinite(logits).all():
                raise ValueError(f"configuration {label}: non-finite logits in window {w}; the cache produced NaN/inf")
            if base is None:
                base = logits
            nll, kl, agree = token_metrics(base, logits, targets)
            acc = out[label]
            acc.seconds += time.perf_counter() - t0
            acc.nll_sum.append(float(nll.sum()))
            acc.num_tokens.append(int(nll.numel()))
            acc.kl_sum.append(float(kl.sum()))
            acc.top1_sum.append(int(agree.sum()))
            acc.kl_tokens.append(kl.float().numpy())
            del logits
        logger.info(
            "window %d/%d scored: %s",
            w + 1,
            len(windows),
            ", ".join(f"{k} nll {out[k].nll_sum[-1] / out[k].num_tokens[-1]:.4f}" for k in order),
        )
    return out


def summarize(tokens: dict[str, ConfigTokens], baseline: str, n_boot: int, seed: int = 0) -> dict[str, dict]:
    """Every accuracy number of every configuration, with bootstrap CIs over windows."""
    b = tokens[baseline]
    bn, bd = np.array(b.nll_sum), np.array(b.num_tokens, dtype=float)
    base_ppl = math.exp(bn.sum() / bd.sum())
    rng = np.random.default_rng(seed + 1)
    out = {}
    for label, t in tokens.items():
        num, den = np.array(t.nll_sum), np.array(t.num_tokens, dtype=float)
        kls, top = np.array(t.kl_sum), np.array(t.top1_sum, dtype=float)
        ppl = math.exp(num.sum() / den.sum())
        delta = paired_bootstrap(num, den, bn, bd, n_boot, seed)
        idx = rng.integers(0, len(num), size=(n_boot, len(num)))
        all_kl = np.concatenate(t.kl_tokens)
        out[label] = {
            "ppl": ppl,
            "ppl_ci95": interval95(np.exp(num[idx].sum(1) / den[idx].sum(1))),
            "ppl_delta_pct": (ppl / base_ppl - 1.0) * 100.0,
            "ppl_delta_pct_ci95": interval95(delta),
            "kl_mean": float(kls.sum() / den.sum()),
            "kl_mean_ci95": interval95(kls[idx].sum(1) / den[idx].sum(1)),
            "kl_p99": float(np.percentile(all_kl, 99)),
            "kl_p99_ci95": interval95(
                np.array([np.percentile(np.concatenate([t.kl_tokens[i] for i in row]), 99) for row in idx[:200]])
            ),
            "kl_max": float(all_kl.max()),
            "top1_agreement": float(top.sum() / den.sum()),
            "top1_agreement_ci95": interval95(top[idx].sum(1) / den[idx].sum(1)),
            "num_tokens": int(den.sum()),
            "score_seconds": t.seconds,
            "per_window": {
                "nll_mean": (num / den).tolist(),
                "kl_mean": (kls / den).tolist(),
                "top1": (top / den).tolist(),
            },
        }
    return out
