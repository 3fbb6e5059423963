"""Fast Walsh-Hadamard transform of a register tile, shared by the cache-write and attention kernels.

:func:`qkv.kernels.quant.hadamard_rotate` is the torch reference: the same
butterflies (stride 1, 2, 4, ..., D/2; ``(a, b) -> (a + b, a - b)``) in the same
order, then one multiply by ``D ** -0.5``. fp32 additions are exactly rounded,
so the kernel result equals the reference bit for bit.

Each stage combines the two halves of the *last* index bit: the row ``[D]`` is viewed
as ``[D / 2, 2]``, split into ``a`` and ``b``, and ``(a + b, a - b)`` are joined back
as ``[D / 2, 2]``; one transpose to ``[2, D / 2]`` then moves that bit to the front, so
the next stage finds the next bit last. After ``log2(D)`` stages every bit has been
combined once, in the order 1, 2, 4, ... (the reference's), and the index bits are back
in place. One small transpose per stage (instead of two around a 4-D view) keeps the
layout conversions, the registers and the compile time down; ``reshape`` keeps element
order (``can_reorder`` is off).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fwht_rows"]


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr, NORM: tl.constexpr):
    """``x`` fp32 ``[ROWS, D]`` -> ``x @ H`` with ``H`` the normalized Hadamard matrix of size ``D``."""
    for _ in tl.static_range(LOG2_D):
        a, b = tl.split(tl.reshape(x, (ROWS, D // 2, 2)))
        y = tl.permute(tl.join(a + b, a - b), (0, 2, 1))  # [ROWS, 2, D / 2]: the combined bit goes first
        x = tl.reshape(y, (ROWS, D))
    return x * NORM
