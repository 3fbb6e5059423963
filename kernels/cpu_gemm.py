"""Launcher for ``csrc/small_gemm.h``: a 16-bit linear layer at decode's row counts, on CPUs without 16-bit
matrix units.

A decode step of one or two sequences is bound by reading the weights. There, torch's bf16 GEMM on an AVX2 CPU
runs well below memory speed, and the fp32 copies that batched steps multiply (``qkv.cpu_linear``) are twice the
bytes; the kernel reads the 16-bit weights once and widens them in registers. At a few dozen rows, where the
arithmetic is the bound, its register tiles keep it ahead of oneDNN's fp32 inner product to about a hundred rows
(``scripts/bench_few_rows.py``). It computes what torch's 16-bit kernels compute (exact products, fp32 sums, one
rounding) in a fixed order that makes every row's result independent of the rows beside it and of the thread
count (the header says which order). Where the build has AVX-512, calls of six rows or more multiply two weight
rows to a register, in that same order: the bits do not depend on which of the two builds ran.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cpu_build import build_library

__all__ = ["SmallGemm"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # paged_cpu.cpp's DType
_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


class _Args(ctypes.Structure):
    _fields_ = [
        ("x", _ptr),
        ("w", _ptr),
        ("bias", _ptr),
        ("y", _ptr),
        ("M", _i64),
        ("N", _i64),
        ("K", _i64),
        ("dtype", _i32),
        ("num_threads", _i32),
    ]


class SmallGemm:
    """``y = x @ w.T + b`` for ``[M, K]`` rows of a bf16 or fp16 model (or an fp32 one, for the row invariance of
    ``--batch-invariant``), through the C++ kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.qkv_small_gemm
        self._fn.argtypes = [ctypes.POINTER(_Args)]
        self._fn.restype = ctypes.c_int
        # 512 where the build multiplies from SMALL_GEMM_WIDEN_ROWS rows on in AVX-512 registers (the same bits);
        # a library built from an older commit (scripts/bench_few_rows.py --baseline) has AVX2's only
        bits = getattr(lib, "qkv_small_gemm_vector_bits", None)
        self.vector_bits: int = bits() if bits is not None else 256

    @classmethod
    def build(cls, build_dir: Path) -> SmallGemm | None:
        """The kernel from the CPU library (compiled on first use); None where this CPU or build lacks AVX2, FMA
        and F16C (the library's entry point then says so). Raises ``KernelBuildError`` without a compiler."""
        gemm = cls(build_library(Path(build_dir)))
        one = torch.ones(1, 8, dtype=torch.bfloat16)
        try:
            ok = torch.equal(gemm(one, one), torch.full((1, 1), 8.0, dtype=torch.bfloat16))
        except RuntimeError:
            return None
        return gemm if ok else None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"small_gemm: x [M, K] and w [N, K] expected, got {list(x.shape)} and {list(w.shape)}")
        if x.dtype not in _DTYPE_CODES or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
            raise ValueError(f"small_gemm: bf16, fp16 or fp32 operands of one dtype expected, got {x.dtype}, {w.dtype}")
        if bias is not None and bias.shape != (w.shape[0],):
            raise ValueError(f"small_gemm: bias of shape [{w.shape[0]}] expected, got {list(bias.shape)}")
        if x.device.type != "cpu" or w.device.type != "cpu":
            raise ValueError("small_gemm: CPU tensors expected")
        bias = None if bias is None else bias.contiguous()
        return self.linear(x.contiguous(), w.contiguous(), bias)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`__call__` without its checks, for callers that guarantee them (contiguous 2-D CPU operands of
        one 16-bit dtype, matching shapes): a decode step makes hundreds of these calls, and the checks would
        cost as much as a small layer's product."""
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
        if x.shape[0] == 0:
            return y
        args = _Args(
            x.data_ptr(),
            w.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            w.shape[0],
            x.shape[1],
            _DTYPE_CODES[x.dtype],
            torch.get_num_threads(),
        )
        rc = self._fn(args)
        if rc != 0:
            raise RuntimeError(f"qkv_small_gemm failed ({'no AVX2/FMA/F16C in this build' if rc == 2 else rc})")
        return y
