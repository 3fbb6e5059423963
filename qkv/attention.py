"""The attention function qkv registers with transformers, and the per-step context it reads.

transformers' model classes call ``ALL_ATTENTION_FUNCTIONS[name](module, q, k, v,
mask, **kwargs)`` with keys already rotated (and k-normed). qkv registers
``"qkv_paged"`` there; every keyword passed to ``model(...)`` reaches it, so the
runner hands over the step's :class:`StepContext` as ``qkv_ctx=...`` instead of
keeping hidden global state. Because ``"qkv_paged"`` is not a mask function
name, transformers skips building dense masks: masking is by positions, inside
the paged kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface

from .kernels import reference
from .kernels.cpu_attention import CpuKernels
from .kernels.cpu_build import KernelBuildError
from .kv_cache import KVCache
from .registry import default_cache_dir

__all__ = ["ATTN_IMPL", "ATTENTION_BACKENDS", "StepContext", "AttentionBackend", "get_backend", "register"]

ATTN_IMPL = "qkv_paged"

logger = logging.getLogger("qkv")


class AttentionBackend(Protocol):
    name: str
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


@dataclass
class StepContext:
    """Everything the attention layers need for one forward over a flattened batch.

    ``observer``, when set, is called as ``observer(layer_idx, key, value)``
    with the ``[T, Hkv, D]`` tensors about to be stored (calibration hooks in here).
    """

    cache: KVCache
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with the null block
    seq_lens: torch.Tensor  # [S] int32, context length after this step
    query_start_loc: torch.Tensor  # [S + 1] int32
    observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None


ATTENTION_BACKENDS = ("cpu", "torch", "triton")


class _TorchBackend:
    """The torch reference (:mod:`qkv.kernels.reference`): one SDPA call per sequence, like transformers."""

    def __init__(self) -> None:
        self.name = "torch"
        self.write_kv_cache = reference.write_kv_cache
        self.paged_attention = reference.paged_attention


class _TritonBackend:
    def __init__(self) -> None:
        # triton is an optional extra (qkv[triton]): imported only when this backend is chosen
        from .kernels.triton_attention import triton_paged_attention
        from .kernels.triton_cache_write import triton_write_kv_cache

        self.name = "triton"
        self.write_kv_cache = triton_write_kv_cache
        self.paged_attention = triton_paged_attention


class _CpuBackend:
    """The fused C++ kernels (:mod:`qkv.kernels.cpu_attention`), compiled on first use."""

    def __init__(self) -> None:
        kernels = CpuKernels.build(default_cache_dir() / "kernels")
        self.name = "cpu"
        self.write_kv_cache = kernels.write_kv_cache
        self.paged_attention = kernels.paged_attention


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """``triton`` on CUDA; on a CPU the fused ``cpu`` kernels, or the ``torch`` reference without a compiler.

    An explicitly named backend that cannot be built is an error; the default
    falls back to the reference with one warning.
    """
    if name is None:
        if device.type == "cuda":
            return _TritonBackend()
        try:
            return _CpuBackend()
        except KernelBuildError as e:
            _warn_once(
                f"qkv: the fused CPU attention kernels could not be built ({str(e).splitlines()[0]}); "
                "falling back to the torch reference path (--attention-backend torch), which is slower"
            )
            return _TorchBackend()
    if name == "torch":
        return _TorchBackend()
    if name == "triton":
        return _TritonBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU only, but the device is {device}")
        return _CpuBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Write this step's K/V into the paged cache, then attend over it (write-then-attend)."""
    ctx: StepContext | None = kwargs.get("qkv_ctx")
    if ctx is None:
        raise RuntimeError("qkv_paged attention called without a qkv_ctx; run the model through qkv's runner")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by qkv_paged")
    layer = ctx.cache.layers[module.layer_idx]
    # [1, H, T, D] -> [T, H, D]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if ctx.observer is not None:
        ctx.observer(module.layer_idx, k, v)
    backend = ctx.backend
    backend.write_kv_cache(
        k,
        v,
        layer.kv,
        ctx.slot_mapping,
        layer.spec.dtype,
        layer.k_scale,
        layer.v_scale,
        layer.scale_cache,
        rotate=layer.spec.rotation is not None,
    )
    if scaling is None:
        scaling = module.head_dim**-0.5 if hasattr(module, "head_dim") else q.shape[-1] ** -0.5
    out = backend.paged_attention(
        q,
        layer.kv,
        ctx.block_tables,
        ctx.seq_lens,
        ctx.query_start_loc,
        layer.spec.dtype,
        layer.k_scale,
        layer.v_scale,
        layer.scale_cache,
        scaling,
        layer.spec.sliding_window,
        rotate=layer.spec.rotation is not None,
    )
    return out.unsqueeze(0), None


_registered = False


def register() -> str:
    """Register the paged attention with transformers (idempotent) and return its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
        _registered = True
    return ATTN_IMPL
