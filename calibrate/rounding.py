"""Compensating a back end that rounds its fp8 cache writes toward zero.

vLLM 0.32's CPU backend rounds onto the e4m3 grid toward zero (eval/results/vllm/fp8_rounding.json): every
cached value shrinks by about half a step, 4 % on average, and no scale can undo that, since the same scale
divides on the write and multiplies on the read. The shrink is a bias, though, not noise: per kv head, the
cached ``K`` is close to ``K / c_k`` and ``V`` to ``V / c_v`` for one factor each, and what is left over is
as large as round-to-nearest's error. Scores are ``q . k``, so ``c_k`` can live in the rows of ``q_proj`` of
the group's query heads; attention outputs are ``P V``, so ``c_v`` can live in the input columns of
``o_proj`` that read them. Both commute with RoPE and with a V rotation (scalars per head).

The factors are the least-squares fit of ``x`` by ``c * x_hat`` (``x_hat`` the value as the back end caches
it) over the calibration set, read off the histograms every calibration keeps (256 bins an octave, finer
than e4m3's 8 steps), at the scales being exported. An engine that rounds to nearest (qkv, vLLM's CUDA
backends) sees the factors as a bias, so they are only ever folded on request, for a named back end.
"""

from __future__ import annotations

import torch

from .stats import TensorStats, bin_edges

__all__ = ["ROUNDINGS", "e4m3_toward_zero", "compensation"]

ROUNDINGS = ("nearest", "toward-zero")
_FINITE = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0x7f is NaN
_EDGES = bin_edges()
_MIDS = ((_EDGES[:-1] + _EDGES[1:]) / 2).float()
_MIDS[-1] = _EDGES[-2].float()  # the open-ended top bin: its lower edge


def e4m3_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded toward zero onto the e4m3 grid, saturated at +-448, as fp32: what a truncating
    fp8 cache write stores (and its read returns) at scale 1."""
    a = x.abs().clamp(max=448.0)
    idx = torch.searchsorted(_FINITE, a, right=True) - 1
    return _FINITE[idx] * torch.sign(x)


def compensation(stats: TensorStats, scale: float, rounding: str) -> torch.Tensor:
    """``[H]`` factors ``c`` minimizing ``sum (x - c * x_hat)^2`` over what ``stats`` saw, per kv head, where
    ``x_hat`` is ``x`` written at ``scale`` by a back end that rounds as ``rounding`` says (1.0 for nearest)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r}: expected one of {', '.join(ROUNDINGS)}")
    if rounding == "nearest":
        return torch.ones(stats.num_heads)
    x = _MIDS.double()
    xq = (e4m3_toward_zero((_MIDS / scale).float()) * scale).double()
    n = stats.hist.double()
    num, den = (n * x * x).sum(-1), (n * x * xq).sum(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num)).float()
