"""How the launchers start a kernel, and the capture mode that records those launches instead.

Every Triton launch in qkv goes through :func:`launch`. Normally it is
``kernel[grid](*args, **kwargs)``. Inside :func:`capture` it records a :class:`Launch`
(kernel, grid, arguments, options) and, unless ``execute=True``, starts nothing. That
gives two things without hand-listing any constexpr:

* the compile check (:mod:`.compile_check`) drives the real launchers on small CPU
  tensors and compiles exactly the specializations they would launch, for each GPU
  architecture, on a machine without a GPU;
* tests read the launch grid (e.g. how many programs a long decode starts).

Some choices depend on the GPU: fp8 conversions exist from sm_89 on, and tiles may
be picked per architecture. Launchers ask :func:`target_arch`, which is the capture's
(or :func:`emulate_arch`'s) architecture when one is set, the device's compute
capability on CUDA (queried at launch, never at import), and ``None`` in the
interpreter.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Launch",
    "launch",
    "capture",
    "emulate_arch",
    "target_arch",
    "fp8_native",
    "device_num_sms",
    "runs_on_gpu",
    "unused_pointer",
]

_CAPTURE: contextvars.ContextVar[tuple[list, bool] | None] = contextvars.ContextVar("qkv_capture", default=None)
_ARCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("qkv_arch", default=None)

DEFAULT_NUM_SMS = 132  # an H200 (and H100 SXM); used where no CUDA device says otherwise


@dataclass
class Launch:
    """One recorded kernel launch: what :func:`launch` was asked to start."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    arch: int | None = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        fn = getattr(self.kernel, "fn", self.kernel)
        self.name = getattr(fn, "__name__", repr(fn))

    @property
    def programs(self) -> int:
        """Number of programs (CTAs) the grid starts."""
        n = 1
        for g in self.grid:
            n *= int(g)
        return n


def target_arch(device: torch.device) -> int | None:
    """Compute capability as ``major * 10 + minor`` (80, 89, 90, 100); ``None`` in the interpreter."""
    forced = _ARCH.get()
    if forced is not None:
        return forced
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor
    return None


def runs_on_gpu(device: torch.device) -> bool:
    """Whether the launch compiles for a GPU: a CUDA device, or a capture for an architecture that runs nothing."""
    active = _CAPTURE.get()
    return device.type == "cuda" or (active is not None and not active[1] and _ARCH.get() is not None)


def fp8_native(arch: int | None) -> bool:
    """Whether the GPU converts to and from fp8 itself (sm_89+; the interpreter emulates it)."""
    return arch is None or arch >= 89


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; :data:`DEFAULT_NUM_SMS` elsewhere and in capture."""
    if device.type == "cuda" and _ARCH.get() is None:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def unused_pointer(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor for pointer arguments a specialization never reads.

    Passing the cache itself instead would give the argument the cache's type, and an
    fp8 pointer type alone stops a kernel from compiling for sm_80.
    """
    return torch.empty(1, device=device, dtype=torch.float32)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, or record it when a :func:`capture` is active."""
    active = _CAPTURE.get()
    if active is not None:
        launches, execute = active
        launches.append(Launch(kernel, tuple(int(g) for g in grid), args, dict(kwargs), _ARCH.get()))
        if not execute:
            return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def capture(arch: int | None = None, execute: bool = False) -> Iterator[list[Launch]]:
    """Record every launch inside the block; launchers pick specializations for ``arch`` (if given).

    With ``execute=False`` (the default) nothing runs: outputs stay uninitialized,
    so only the recorded launches are meaningful.
    """
    launches: list[Launch] = []
    token = _CAPTURE.set((launches, execute))
    arch_token = _ARCH.set(arch) if arch is not None else None  # None keeps an outer emulate_arch
    try:
        yield launches
    finally:
        if arch_token is not None:
            _ARCH.reset(arch_token)
        _CAPTURE.reset(token)


@contextlib.contextmanager
def emulate_arch(arch: int) -> Iterator[None]:
    """Run the launchers as they run on ``arch`` (e.g. 80: integer fp8 paths), kernels included."""
    token = _ARCH.set(arch)
    try:
        yield
    finally:
        _ARCH.reset(token)
