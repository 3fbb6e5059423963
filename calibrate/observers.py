"""Observers: turn one tensor's :class:`~qkv.calibrate.stats.TensorStats` into a clipping amax.

The scale is then ``amax / qmax`` (448 for fp8 e4m3, 127 for int8).

* ``minmax``: the true absmax over every observed value (llm-compressor's
  ``static_minmax``); never clips.
* ``percentile``: the P-th percentile of ``|x|`` (per tensor or per head), from
  the log-histogram: a fraction ``1 - P/100`` of the values is clipped.
* ``mse``: the clipping ratio ``r`` of the absmax (1.00, 0.99, ... 0.20) whose
  quantize-dequantize round trip in the target dtype (qkv's own kernels) has
  the smallest squared error on a uniform reservoir sample of the values. Ratio
  1.0 (minmax) is a candidate and ties go to the larger ratio, so on the sample
  the result is never worse than minmax.
"""

from __future__ import annotations

import torch

from qkv.kernels.quant import CacheDtype, dequantize, quantize

from .stats import TensorStats, single_thread

__all__ = ["Observer", "MinMax", "Percentile", "MSE", "make_observer", "OBSERVER_NAMES", "scales_from_amax"]

OBSERVER_NAMES = ("minmax", "percentile", "mse")


class Observer:
    name = ""
    reservoir = 0  # how many |x| values per head the statistics must sample

    def amax(self, stats: TensorStats, per_head: bool, dt: CacheDtype) -> torch.Tensor:
        """Clipping threshold, fp32 ``[H]`` (per head) or ``[1]`` (per tensor)."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"observer": self.name}


class MinMax(Observer):
    name = "minmax"

    def amax(self, stats, per_head, dt):
        return stats.absmax(per_head)


class Percentile(Observer):
    name = "percentile"

    def __init__(self, percentile: float = 99.99) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"--percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile

    def amax(self, stats, per_head, dt):
        return stats.quantile(self.percentile / 100.0, per_head)

    def describe(self) -> dict:
        return {"observer": self.name, "percentile": self.percentile}


class MSE(Observer):
    name = "mse"

    def __init__(self, reservoir: int = 1 << 16, min_ratio: float = 0.2, steps: int = 81) -> None:
        self.reservoir = reservoir
        self.ratios = torch.linspace(1.0, min_ratio, steps)

    def amax(self, stats, per_head, dt):
        base = stats.absmax(per_head)
        x = stats.reservoir(per_head)  # [N, H, 1] or [N, 1, 1], fp32 |x|
        best_err = torch.full_like(base, float("inf"), dtype=torch.float64)
        best = base.clone()
        with single_thread():
            for r in self.ratios.tolist():
                amax = base * r
                scale = torch.where(amax > 0, amax / dt.qmax, torch.ones_like(amax))
                err = mse_per_head(x, scale, dt)
                better = err < best_err  # strict: ties keep the larger ratio
                best_err = torch.where(better, err, best_err)
                best = torch.where(better, amax, best)
        return best

    def describe(self) -> dict:
        return {
            "observer": self.name,
            "mse_ratios": [round(float(self.ratios[0]), 4), round(float(self.ratios[-1]), 4), len(self.ratios)],
            "mse_reservoir_per_head": self.reservoir,
        }


def mse_per_head(x: torch.Tensor, scale: torch.Tensor, dt: CacheDtype) -> torch.Tensor:
    """Sum of squared quantize-dequantize errors of ``x`` ([N, H, D]) per head, fp64 ``[H]``."""
    y = dequantize(quantize(x, scale, dt), scale, dt, torch.float32)
    return (y.double() - x.double()).pow(2).sum(dim=(0, 2))


def make_observer(name: str, percentile: float | None = None) -> Observer:
    if name == "minmax":
        return MinMax()
    if name == "percentile":
        return Percentile(99.99 if percentile is None else percentile)
    if name == "mse":
        return MSE()
    raise ValueError(f"unknown observer {name!r}; choose one of: {', '.join(OBSERVER_NAMES)}")


def scales_from_amax(amax: torch.Tensor, dt: CacheDtype) -> torch.Tensor:
    """``s = amax / qmax`` in fp32; an all-zero tensor (amax 0) gets scale 1.0 (any scale is exact for it)."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / dt.qmax, torch.ones_like(amax))
