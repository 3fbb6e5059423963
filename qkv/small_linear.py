"""A 16-bit model's linear layers for the rows of a decode step, on CPUs without 16-bit matrix units.

Why: a call of one or two rows is bound by reading the weights. On such a CPU torch's bf16 GEMM widens them in a
loop that runs well below memory speed, and qkv's fp32 copies (:mod:`qkv.cpu_linear`) are twice the bytes, so
:class:`~qkv.cpu_linear.Fp32Linear` sends calls of up to about a hundred rows here: the C++ kernel of
:mod:`qkv.kernels.cpu_gemm`, which reads the 16-bit weights once and, at a few dozen rows, multiplies faster than
oneDNN's fp32 inner product on the copies. It computes what torch's bf16 kernel computes (exact products, fp32 sums, one
rounding), in a fixed order of its own, so a row's bits do not depend on the rows beside it or the thread count.
Where the kernel cannot be built (no C++ compiler, a CPU without AVX2), torch's GEMM takes the call.

Under ``--batch-invariant`` the kernel takes every call, fp32 models' included (:class:`KernelLinear`): its fixed
order makes a row's bits independent of the call's shape without padding to one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .batch_invariant import TILE
from .kernels.cpu_build import KernelBuildError
from .kernels.cpu_gemm import SmallGemm
from .registry import default_cache_dir

__all__ = ["KernelLinear", "few_rows_kernel", "few_rows_linear"]

logger = logging.getLogger("qkv")

_16BIT = (torch.bfloat16, torch.float16)


@functools.cache
def few_rows_kernel() -> SmallGemm | None:
    """The kernel, built once per process into the CPU kernels' cache directory (the library that holds qkv's
    attention kernels); None, with one warning, where it cannot be built."""
    try:
        kernel = SmallGemm.build(default_cache_dir() / "kernels")
    except KernelBuildError as e:
        logger.warning("qkv: few-row linears use torch's GEMM: the CPU kernels did not build (%s)", e)
        return None
    if kernel is None:
        logger.warning("qkv: few-row linears use torch's GEMM: the CPU kernels were built without AVX2/FMA/F16C")
    return kernel


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 16-bit ``x`` of a few rows, through the kernel where there is one.

    Every check here is an attribute read: the call runs once per linear of a decode step."""
    kernel = few_rows_kernel()
    if (
        kernel is None
        or not x.is_cpu
        or x.dtype not in _16BIT
        or weight.dtype != x.dtype
        or (bias is not None and bias.dtype != x.dtype)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.contiguous()
    if x.dim() == 2:  # the compiled path's calls: no reshape either way
        return kernel.linear(x.contiguous(), weight.contiguous(), b)
    y = kernel.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), b)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class KernelLinear:
    """While entered, the given ``nn.Linear`` modules multiply through the kernel at every row count: the linears
    of ``--batch-invariant`` where the kernel exists (:func:`~qkv.cpu_linear.linear_modes` picks them: a 16-bit
    model's whose linears multiply in fp32, on a CPU without 16-bit matrix units, or an fp32 model's).

    Why: the kernel's order of operations depends on K alone (``small_gemm.h``), so a row's bits are the same
    in a call of any shape, at any thread count. That is the invariance the fixed ``TILE``-row calls of
    :class:`~qkv.batch_invariant.BatchInvariantLinear` buy with zero padding, which makes a one-row decode step
    do 48 rows of arithmetic. Longer inputs go in calls of at most ``TILE`` rows, which keeps x in L2 while each
    weight tile passes over it; the split changes no bits. Swapped in and out like the other modes
    (:class:`~qkv.cpu_linear.Fp32Linear`), so the model stays shareable; there are no copies to make."""

    def __init__(self, linears: list[torch.nn.Linear], kernel: SmallGemm) -> None:
        self.linears = linears
        self.forwards: list[Callable[[torch.Tensor], torch.Tensor]] = [
            functools.partial(
                self._forward, kernel, m.weight.detach().contiguous(), None if m.bias is None else m.bias.detach()
            )
            for m in linears
        ]

    def __enter__(self) -> KernelLinear:
        for m, forward in zip(self.linears, self.forwards):
            m.__dict__["forward"] = forward  # an instance attribute; Module.__setattr__ costs microseconds
        return self

    def __exit__(self, *exc) -> None:
        for m in self.linears:
            m.__dict__.pop("forward", None)

    @staticmethod
    def _forward(kernel: SmallGemm, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != w.dtype or (torch.is_grad_enabled() and x.requires_grad):
            # torch's GEMM here would round another way: the invariance is the point, so no silent fallback
            raise TypeError(f"KernelLinear: {w.dtype} inputs without grad expected, got {x.dtype}")
        parts = [kernel.linear(p, w, b) for p in x.reshape(-1, x.shape[-1]).contiguous().split(TILE)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.reshape(*x.shape[:-1], w.shape[0])
