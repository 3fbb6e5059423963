"""Optional batch-invariant linear layers: each sequence's rows go through their own GEMM.

Why: the CPU bf16 GEMM (oneDNN) blocks the M dimension differently for
different row counts, so a token's ``down_proj`` output can differ in the last
bit depending on how many other tokens share the step (measured here: 317 of
320 row counts give some row a different result for a 1536->576 GEMM).
fp32 GEMMs on the same machine are row-invariant. Paged attention is already
per-sequence, so with this mode a flattened batch computes exactly what each
sequence would alone, and bf16 greedy outputs match ``transformers.generate``
run prompt by prompt. It costs one GEMM per sequence instead of one per step,
so it is off by default; the BF16 exactness tests turn it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PerSequenceLinear"]


class PerSequenceLinear(TorchFunctionMode):
    """Split every ``F.linear`` over the flattened batch at sequence boundaries.

    ``segments`` are the query lengths of the step's sequences. An input with
    another row count (the ``lm_head`` on the rows that sample, one per
    sequence) is split row by row.
    """

    def __init__(self, segments: list[int]) -> None:
        super().__init__()
        self.segments = segments
        self.total = sum(segments)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x = args[0]
        rows = x.shape[-2] if x.dim() >= 2 else 1
        sizes = self.segments if rows == self.total else [1] * rows
        if len(sizes) <= 1:
            return func(*args, **kwargs)
        parts = [func(part, *args[1:], **kwargs) for part in torch.split(x, sizes, dim=-2)]
        return torch.cat(parts, dim=-2)
