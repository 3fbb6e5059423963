"""Next-token metrics of one configuration's logits against a baseline's: what a KV-cache format costs.

Shared by ``qkv eval`` (perplexity, KL, top-1 over evaluation windows) and
``qkv calibrate --auto-skip`` (per-layer sensitivity on held-out chunks), so the
two never disagree on a formula. Per position ``t`` of a window:

* ``nll_t = -log q(x_{t+1} | x_{<=t})``; perplexity is ``exp(sum nll / n)``;
* ``KL_t = sum_v p_v (log p_v - log q_v)`` with ``p`` the baseline's and ``q`` the
  configuration's next-token distribution;
* top-1 agreement: ``argmax p == argmax q``.

A perplexity budget such as ``--max-ppl-delta 0.2%`` is read by :func:`parse_threshold`, and both tools put
a window-level interval on a ppl change with :func:`paired_bootstrap`.
"""

from __future__ import annotations

import re

import numpy as np
import torch

__all__ = ["token_metrics", "token_nll", "parse_threshold", "paired_bootstrap", "interval95", "ROWS"]

ROWS = 256  # rows of [T, vocab] processed at a time: bounds memory for 262k-token vocabularies


@torch.inference_mode()
def token_metrics(
    base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position ``(nll, kl, top1_agree)`` for logits ``[T, V]`` predicting ``targets [T]``."""
    nll, kl, agree = [], [], []
    for s in range(0, logits.shape[0], ROWS):
        lq = torch.log_softmax(logits[s : s + ROWS].float(), dim=-1)
        lp = torch.log_softmax(base_logits[s : s + ROWS].float(), dim=-1)
        nll.append(_nll(lq, targets[s : s + ROWS]))
        kl.append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0))
        agree.append(lp.argmax(-1) == lq.argmax(-1))
    return torch.cat(nll).double(), torch.cat(kl).double(), torch.cat(agree)


@torch.inference_mode()
def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL of ``targets [T]`` under ``logits [T, V]``: the ``nll`` of :func:`token_metrics`
    without a baseline."""
    return torch.cat(
        [
            _nll(torch.log_softmax(logits[s : s + ROWS].float(), dim=-1), targets[s : s + ROWS])
            for s in range(0, logits.shape[0], ROWS)
        ]
    ).double()


def paired_bootstrap(
    num: np.ndarray, den: np.ndarray, base_num: np.ndarray, base_den: np.ndarray, n_boot: int, seed: int
) -> np.ndarray:
    """Bootstrap samples of the ppl change in percent from per-window NLL sums ``num`` over ``den`` tokens.

    Each resample picks the same windows for the configuration and the baseline: the windows' difficulty is
    shared, so pairing leaves only the noise of the change itself.
    """
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    ppl = np.exp(num[idx].sum(1) / den[idx].sum(1))
    base = np.exp(base_num[idx].sum(1) / base_den[idx].sum(1))
    return (ppl / base - 1.0) * 100.0


def interval95(samples: np.ndarray) -> list[float]:
    """The central 95 % of bootstrap ``samples``: ``[2.5th, 97.5th]`` percentile."""
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return [float(lo), float(hi)]


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -log_probs.gather(1, targets[:, None]).squeeze(1)


def parse_threshold(text: str | float | None, what: str) -> float | None:
    """``"1.0%"`` / ``"1"`` -> 1.0; ``None`` stays ``None``; ``what`` names the flag in the error."""
    if text is None or isinstance(text, (int, float)):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*%?\s*", text)
    if not m:
        raise ValueError(f"{what} takes a non-negative number (e.g. 1.0% or 0.01), got {text!r}")
    return float(m.group(1))
