"""The Triton kernels as an attention back end (``--attention-backend triton``, the default on CUDA).

Kept apart from the kernels so that importing the launchers stays optional: triton is an extra
(``qkv[triton]``), imported only when this back end is chosen.
"""

from __future__ import annotations

import torch

from .paged import PagedLayer, StepMetadata
from .triton_attention import triton_attend
from .triton_cache_write import triton_write

__all__ = ["TritonKernels"]


class TritonKernels:
    """``write`` and ``attend`` through :mod:`.triton_cache_write` and :mod:`.triton_attention`."""

    name = "triton"

    def __init__(self, num_sms: int | None = None) -> None:
        self.num_sms = num_sms  # the split-KV heuristic's SM count (default: the device's)

    def prepare(self, layer: PagedLayer) -> None:
        """The kernels' tiles and the in-register Hadamard transform need a power-of-two head_dim."""
        d = layer.head_dim
        if d < 16 or d & (d - 1):
            raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16 (64, 128, 256), got {d}")

    def write(self, layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None:
        triton_write(layer, key, value, meta)

    def attend(self, layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float) -> torch.Tensor:
        return triton_attend(layer, query, meta, sm_scale, num_sms=self.num_sms)
