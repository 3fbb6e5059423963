"""Fast Walsh-Hadamard transform of a register tile, shared by the cache-write and attention kernels.

:func:`qkv.kernels.quant.hadamard_rotate` is the torch reference: the same
butterflies (stride 1, 2, 4, ..., D/2; ``(a, b) -> (a + b, a - b)``) in the same
order, then one multiply by ``D ** -0.5``. fp32 additions are exactly rounded,
so the kernel result equals the reference bit for bit.

A stage of stride ``h`` views each row as ``[D / 2h, 2, h]``: the pairs to
combine are the two entries of the middle axis. Triton splits only a trailing
axis of size 2, so the tile is permuted to ``[D / 2h, h, 2]``, split, joined
back and permuted again; ``reshape`` keeps element order (``can_reorder`` is off).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fwht_rows"]


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr, NORM: tl.constexpr):
    """``x`` fp32 ``[ROWS, D]`` -> ``x @ H`` with ``H`` the normalized Hadamard matrix of size ``D``."""
    for i in tl.static_range(LOG2_D):
        y = tl.reshape(x, (ROWS, D // (2 << i), 2, 1 << i))
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (ROWS, D))
    return x * NORM
