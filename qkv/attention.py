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

import torch
from transformers import AttentionInterface

from .compiled import paged_attention
from .kernels.cpu_attention import CpuKernels
from .kernels.cpu_build import KernelBuildError
from .kernels.paged import AttentionBackend, StepMetadata
from .kernels.reference import TorchReference
from .kv_cache import KVCache
from .registry import default_cache_dir

__all__ = ["ATTN_IMPL", "ATTENTION_BACKENDS", "StepContext", "get_backend", "register"]

ATTN_IMPL = "qkv_paged"

logger = logging.getLogger("qkv")


@dataclass
class StepContext:
    """Everything the attention layers need for one forward over a flattened batch.

    ``meta`` is built once per step by the runner; every layer reads it and none rebuilds it.
    ``observer``, when set, is called as ``observer(layer_idx, key, value, query)``
    with the ``[T, Hkv, D]`` tensors about to be stored and the ``[T, H, D]`` queries, in the cache's key basis
    where the layer has one (calibration hooks in here).
    """

    cache: KVCache
    backend: AttentionBackend
    meta: StepMetadata
    observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def attend_layer(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Write this step's ``[T, Hkv, D]`` keys and values of one layer into its cache, then attend over it with
        the ``[T, H, D]`` queries (write-then-attend): the eager and the compiled forward both come here."""
        layer = self.cache.layers[layer_idx]
        if layer.key_basis is not None:  # centred and smoothed K for a calibrated 4-bit cache (qkv.key_basis)
            q, k = layer.key_basis.queries(q), layer.key_basis.keys(k)
        if self.observer is not None:
            self.observer(layer_idx, k, v, q)
        self.backend.write(layer, k, v, self.meta)
        return self.backend.attend(layer, q, self.meta, scaling)


ATTENTION_BACKENDS = ("cpu", "torch", "triton")


def _triton() -> AttentionBackend:
    # triton is an optional extra (qkv[triton]): imported only when this backend is chosen
    from .kernels.triton_backend import TritonKernels

    return TritonKernels()


def _cpu(row_invariant: bool) -> AttentionBackend:
    return CpuKernels.build(default_cache_dir() / "kernels", dense_prefill=not row_invariant)


def get_backend(name: str | None, device: torch.device, row_invariant: bool = False) -> AttentionBackend:
    """``triton`` on CUDA; on a CPU the fused ``cpu`` kernels, or the ``torch`` reference without a compiler.

    An explicitly named backend that cannot be built is an error; the default
    falls back to the reference with one warning. ``row_invariant`` (``--batch-invariant``): every row
    computed by operations that do not depend on the batch (the CPU kernels then keep long prefill chunks
    on their fused loop instead of torch's SDPA).
    """
    if name is None:
        if device.type == "cuda":
            return _triton()
        try:
            return _cpu(row_invariant)
        except KernelBuildError as e:
            _warn_once(
                f"qkv: the fused CPU attention kernels could not be built ({str(e).splitlines()[0]}); "
                "falling back to the torch reference path (--attention-backend torch), which is slower"
            )
            return TorchReference()
    if name == "torch":
        return TorchReference()
    if name == "triton":
        return _triton()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU only, but the device is {device}")
        return _cpu(row_invariant)
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
    """Write this step's K/V into the paged cache, then attend over it (write-then-attend).

    Eagerly the step's context comes as ``qkv_ctx=``; under ``torch.compile`` (:mod:`qkv.compiled`) the layer is
    one opaque op that reads the context the runner set, so the graph does not trace the context object."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by qkv_paged")
    if scaling is None:
        scaling = module.head_dim**-0.5 if hasattr(module, "head_dim") else query.shape[-1] ** -0.5
    # [1, H, T, D] -> [T, H, D]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if torch.compiler.is_compiling():
        out = paged_attention(q, k, v, module.layer_idx, float(scaling))
    else:
        ctx: StepContext | None = kwargs.get("qkv_ctx")
        if ctx is None:
            raise RuntimeError("qkv_paged attention called without a qkv_ctx; run the model through qkv's runner")
        out = ctx.attend_layer(module.layer_idx, q, k, v, scaling)
    return out.unsqueeze(0), None


_registered = False


def register() -> str:
    """Register the paged attention with transformers (idempotent) and return its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
        _registered = True
    return ATTN_IMPL
