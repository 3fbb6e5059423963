"""Batch-invariant linear layers: every GEMM call has the same shape, whatever the batch.

Why: a CPU GEMM's result for one row depends on how many rows share the call.
oneDNN/MKL pick their blocking and even their algorithm from the shape: measured
here, fp32 calls of 1-3 rows round differently from calls of 4 or more, and on CPUs
with AMX the bf16 GEMM changes some row's last bit for 317 of 320 row counts. So
the same request gives other bits alone than inside a batch, after a prefix-cache
hit, or when its prefill is chunked differently, and an 8-bit cache amplifies a
last-bit change into a different code.

:class:`BatchInvariantLinear` makes the guarantee true by construction: every
``F.linear`` runs in calls of exactly ``TILE`` rows (the last one zero-padded), so
every row goes through the same kernel with the same blocking. Rows of one call
are independent and the kernel treats every row position alike (checked by
``tests/core/test_batch_invariant.py`` on the machine that runs the tests). Together
with the row-invariant CPU attention (:mod:`qkv.kernels.cpu_attention`) and
per-row elementwise ops, a request's tokens do not depend on what it is batched
with. It costs the padding and one call per tile, so it is off by default.

On a CPU, an fp32 model's linears, and a 16-bit model's that multiply in fp32, run
instead on qkv's few-row kernel (:class:`~qkv.small_linear.KernelLinear`), whose
order of operations depends on the reduction length alone: row-invariant without
padding. The tiles stay on top for whatever else calls ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["BatchInvariantLinear", "TILE"]

# Rows per GEMM call. What matters is that every row position of a TILE-row call runs the same micro-kernel: a
# multiple of the row blocks of AMX and AVX-512 (16) and of MKL's AVX2 sgemm (6 and 8). 32 is not: under MKL's
# AVX2 code path (``MKL_ENABLE_INSTRUCTIONS=AVX2`` on an Intel Xeon) some rows of a 32-row fp32 call rounded
# differently by position; 48 passed there and on every oneDNN ISA level, fp32 and bf16.
TILE = 48


class BatchInvariantLinear(TorchFunctionMode):
    """Run every ``F.linear`` over the flattened rows in fixed ``[TILE, in_features]`` calls."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        pad = -n % TILE
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        out = torch.cat([func(tile, *args[1:], **kwargs) for tile in rows.split(TILE)])
        return out[:n].reshape(*x.shape[:-1], out.shape[-1])
