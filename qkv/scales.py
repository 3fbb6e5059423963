"""Where each quantized layer's static K/V scales come from."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .kv_cache import LayerSpec

__all__ = ["resolve_scales"]

logger = logging.getLogger("qkv")
_warned = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def resolve_scales(specs: list[LayerSpec], model_path: Path, kv_scales: str | None,
                   kv_cache_dtype: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Static scales per quantized layer, as ``{layer_idx: (k_scale, v_scale)}``.

    Uncalibrated fp8 falls back to scale 1.0 with a warning, as vLLM does;
    static int8 has no sensible default, so it is an error that says how to calibrate.
    """
    static = [s for s in specs if s.dtype.quantized and not s.dtype.dynamic]
    if not static:
        return {}
    if kv_scales is not None:
        raise NotImplementedError("--kv-scales is not implemented yet")
    if static[0].dtype.kind == "int":
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} needs calibrated scales: run "
            f"`qkv calibrate MODEL --kv-cache-dtype int8 -o OUT` and pass OUT as the model or --kv-scales OUT, "
            f"or use the dynamic int8_per_token_head mode")
    _warn_once(f"Using KV cache scaling factor 1.0 for {kv_cache_dtype}: the checkpoint has no calibrated "
               f"k_scale/v_scale. This may hurt accuracy; calibrate with `qkv calibrate`.")
    return {s.layer_idx: (torch.ones(1), torch.ones(1)) for s in static}
