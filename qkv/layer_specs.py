"""Decide each layer's cache dtype: ``--kv-cache-dtype`` minus ``--kv-cache-dtype-skip-layers``, which take
``--kv-cache-dtype-skip-dtype``."""

from __future__ import annotations

import torch

from .config import parse_skip_layers
from .kernels.quant import check_rotation, resolve_cache_dtype
from .kv_cache import LayerSpec

__all__ = ["SKIP_DTYPES", "build_layer_specs", "check_skip_dtype"]

# What skipped layers may hold: the model's dtype (vLLM's meaning of a skipped layer), or an 8-bit cache that
# scales each token by itself, so that a layer too sensitive for 4 bits still costs half of 16 (qkv extension;
# a statically scaled 8-bit dtype would need scales that the calibration of the 4-bit layers does not make).
SKIP_DTYPES = ("auto", "int8_per_token_head", "fp8_per_token_head")


def check_skip_dtype(name: str) -> None:
    """A clear error for a dtype skipped layers cannot take."""
    if name not in SKIP_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype-skip-dtype must be one of {', '.join(SKIP_DTYPES)} (auto: the model's dtype), "
            f"got {name!r}"
        )


def build_layer_specs(
    layout: list[dict],
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    skip_layers=None,
    rotation: str | None = None,
    skip_dtype: str = "auto",
) -> list[LayerSpec]:
    """One :class:`LayerSpec` per layer; skipped layers take ``skip_dtype``: by default the model dtype (BF16 for
    bf16 models), or a per-token 8-bit cache (:data:`SKIP_DTYPES`).

    ``skip_layers`` takes ``"sliding_window"`` and/or layer indices, as vLLM's
    ``--kv-cache-dtype-skip-layers``. Indices are checked against the model.
    ``rotation`` (``"hadamard"``) applies to every layer that is not skipped:
    a skipped layer is never rotated: a plain BF16 copy, exactly as without qkv's extensions, or a per-token
    8-bit one.
    """
    check_skip_dtype(skip_dtype)
    dt = resolve_cache_dtype(kv_cache_dtype, model_dtype)
    plain = resolve_cache_dtype(skip_dtype, model_dtype)
    skip_sliding, indices = parse_skip_layers(skip_layers)
    n = len(layout)
    bad = [i for i in indices if not 0 <= i < n]
    if bad:
        raise ValueError(
            f"--kv-cache-dtype-skip-layers index {bad[0]} is out of range: the model has {n} layers (0..{n - 1})"
        )
    if skip_sliding and not any(d["sliding_window"] for d in layout):
        raise ValueError("--kv-cache-dtype-skip-layers sliding_window: this model has no sliding-window layers")
    specs = []
    for d in layout:
        skip = d["layer_idx"] in indices or (skip_sliding and d["sliding_window"] is not None)
        rot = None if skip else check_rotation(rotation, d["head_dim"])
        specs.append(
            LayerSpec(d["layer_idx"], d["num_kv_heads"], d["head_dim"], plain if skip else dt, d["sliding_window"], rot)
        )
    return specs
