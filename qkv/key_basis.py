"""A calibrated change of basis for K (centred, then smoothed against Q) before a per-token 4-bit cache.

Why: a per-token scale spends int4's 16 levels on the row's largest value. After RoPE, K of a small model
carries a large static offset in a few channels (the same for every token) and channels whose spread differs
by an order of magnitude, so most of each row is coarse. Two changes that leave attention unchanged in exact
arithmetic move the rounding error to where it matters less:

* **centring**: ``K - mu``, with ``mu`` K's mean per kv head and channel over the calibration tokens. Every
  score of one query moves by the same ``q . mu``, which softmax ignores, so nothing is added back;
* **smoothing**: ``K / s`` and ``Q * s`` per kv head and channel (every query head of the group alike), so
  ``q . k`` is unchanged. After the cache's Hadamard rotation the rounding error of a row is spread evenly
  over the channels with a size that follows ``|K / s|``, so a score's error follows
  ``E|Q s|^2 E|K / s|^2``, which is least at ``s = (rms(K - mu) / rms(Q)) ** (1/2)`` per channel (Cauchy-Schwarz).
  Calibration takes half that power, :data:`SMOOTHING_POWER`: the model ignores that a row's scale is set by
  its largest value, and at the full power it lost to half of it on SmolLM2 (lab notes, eval/results). Each
  head is normalized to a geometric mean of 1, so the tensors' magnitudes do not drift. The channels are
  smoothed one by one: RoPE's pairs need no common factor, because K and Q are smoothed after RoPE.

Both happen in the engine before any back end sees K and Q (:meth:`qkv.attention.StepContext.attend_layer`),
so every back end stores and reads the same bytes it would for those inputs: the basis is part of the cache's
calibration, carried in the checkpoint beside the clipping ratios (``self_attn.k_mean`` / ``k_smooth``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SMOOTHING_POWER", "KeyBasis", "KeyStats", "smoothing_factors"]

SMOOTHING_POWER = 0.25


@dataclass(frozen=True, eq=False)
class KeyBasis:
    """One layer's ``mean`` and ``smooth`` (fp32 ``[Hkv, D]``, ``smooth > 0``): keys become
    ``(k - mean) / smooth`` and queries ``q * smooth`` (per kv head, repeated over its query heads)."""

    mean: torch.Tensor
    smooth: torch.Tensor

    def __post_init__(self) -> None:
        if self.mean.shape != self.smooth.shape or self.mean.dim() != 2:
            raise ValueError(
                f"k_mean and k_smooth must both be [Hkv, D], got {tuple(self.mean.shape)} and "
                f"{tuple(self.smooth.shape)}"
            )
        if not bool(torch.isfinite(self.mean).all()) or not bool(
            (self.smooth > 0).all() & torch.isfinite(self.smooth).all()
        ):
            raise ValueError("k_mean must be finite and k_smooth finite and positive")

    def to(self, device: torch.device | str) -> KeyBasis:
        return KeyBasis(
            self.mean.to(device=device, dtype=torch.float32), self.smooth.to(device=device, dtype=torch.float32)
        )

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """``[T, Hkv, D]`` keys in the cache's basis, in fp32 then back to ``k``'s dtype."""
        return ((k.to(torch.float32) - self.mean) / self.smooth).to(k.dtype)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` queries in the same basis (query head ``h`` reads kv head ``h // (H / Hkv)``)."""
        grouped = q.to(torch.float32).unflatten(1, (self.smooth.shape[0], -1))  # [T, Hkv, group, D]: no copy of s
        return (grouped * self.smooth[:, None]).flatten(1, 2).to(q.dtype)


class KeyStats:
    """Running sums of one layer's K, K^2 and Q^2 per kv head and channel (fp64), for :func:`smoothing_factors`."""

    def __init__(self) -> None:
        self.sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # sum K, sum K^2, sum Q^2
        self.tokens = 0

    def update(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` as the attention layer receives them (after RoPE)."""
        t, hkv, d = k.shape
        k64 = k.to(torch.float64)
        q_sq = q.to(torch.float64).square().reshape(t, hkv, -1, d).mean(2).sum(0)
        new = (k64.sum(0), k64.square().sum(0), q_sq)
        self.sums = new if self.sums is None else (self.sums[0] + new[0], self.sums[1] + new[1], self.sums[2] + new[2])
        self.tokens += t

    def basis(self, power: float = SMOOTHING_POWER) -> KeyBasis:
        if self.sums is None:
            raise ValueError("no tokens observed for this layer's K statistics")
        k_sum, k_sq, q_sq = (x / self.tokens for x in self.sums)
        k_var = (k_sq - k_sum.square()).clamp_min(0.0)
        return KeyBasis(k_sum.to(torch.float32), smoothing_factors(k_var, q_sq, power))


def smoothing_factors(k_var: torch.Tensor, q_sq: torch.Tensor, power: float = SMOOTHING_POWER) -> torch.Tensor:
    """``[Hkv, D]`` fp32 ``s = (rms(K - mu) / rms(Q)) ** power`` from K's variance and Q's mean square per channel,
    each head scaled to a geometric mean of 1. ``power = 0`` gives all ones (centring alone)."""
    ratio = (k_var.to(torch.float64).clamp_min(1e-12) / q_sq.to(torch.float64).clamp_min(1e-12)).sqrt().pow(power)
    return (ratio / ratio.log().mean(-1, keepdim=True).exp()).to(torch.float32)
