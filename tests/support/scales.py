"""Scales files for the eval tests: observed per-layer absmax, written in compressed-tensors form."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from qkv.scoring import prefill_logits

__all__ = ["observe_amax", "write_scales_dir"]


def observe_amax(engine, windows) -> tuple[dict, dict]:
    """Per-layer absmax of the K and V the cache stores (what `qkv calibrate` observes)."""
    k, v = {}, {}

    def obs(layer, key, value, query):
        k[layer] = max(k.get(layer, 0.0), float(key.abs().max()))
        v[layer] = max(v.get(layer, 0.0), float(value.abs().max()))

    for ids in windows:
        prefill_logits(engine, ids, observer=obs, keep_logits=False)
    return k, v


def write_scales_dir(
    path: Path, k_amax: dict, v_amax: dict, divide: float = 1.0, qmax: float = 448.0, kind: str = "float"
) -> Path:
    """A compressed-tensors scales directory (per-tensor), scales = amax / qmax / divide."""
    path.mkdir(parents=True, exist_ok=True)
    scheme = {"num_bits": 8, "type": kind, "strategy": "tensor", "dynamic": False, "symmetric": True}
    (path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}})
    )
    tensors = {}
    for i in k_amax:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k_amax[i] / qmax / divide])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v_amax[i] / qmax / divide])
    save_file(tensors, str(path / "kv_scales.safetensors"))
    return path
