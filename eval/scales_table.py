"""Per-layer K/V ranges of each statically scaled configuration, for the report's third figure.

Preferred source: ``calibration.json`` in the configuration's scales directory
(written by ``qkv calibrate``), read loosely: a per-layer table (a list, or a
dict keyed by layer index, under ``layers`` or at the top level) whose entries
name K and V amax and/or scale in any of the usual spellings (``k_amax``,
``key_amax``, ``{"k": {"amax": ...}}``, ``k_scale``...). Fallback: the engine's
own ``k_scale``/``v_scale`` per layer. Everything is shown as an amax
(``scale * qmax``, 448 for fp8 e4m3 and 127 for int8) so fp8 and int8 scales of
the same tensors line up; uncalibrated fp8 (scale 1.0) shows as 448.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["read_calibration_json", "layer_ranges"]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}_{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flat(v, key))
        else:
            out[re.sub(r"[^a-z0-9]+", "_", key.lower())] = v
    return out


def _values(v) -> list[float] | None:
    if isinstance(v, (int, float)):
        return [float(v)]
    if isinstance(v, list):
        flat = []
        for x in v:
            if isinstance(x, list):
                flat += [float(y) for y in x if isinstance(y, (int, float))]
            elif isinstance(x, (int, float)):
                flat.append(float(x))
        return flat or None
    return None


def _pick(entry: dict, which: str, quantity: str):
    pat = re.compile(rf"(^|_)({which}|{'key' if which == 'k' else 'value'})(_.*)?_{quantity}$")
    for key, v in entry.items():
        if pat.search(key) and _values(v):
            return _values(v)
    return None


def _layer_entries(data) -> list[dict] | None:
    table = data.get("layers", data.get("per_layer", data)) if isinstance(data, dict) else data
    if isinstance(table, dict):
        items = [(int(k), v) for k, v in table.items() if str(k).isdigit() and isinstance(v, dict)]
        return [v for _, v in sorted(items)] or None
    if isinstance(table, list) and table and all(isinstance(x, dict) for x in table):
        key = next((k for k in ("layer", "layer_idx", "index") if k in table[0]), None)
        return sorted(table, key=lambda x: x[key]) if key else table
    return None


def read_calibration_json(scales_dir: str | Path, qmax: float) -> dict | None:
    """``{"k": [[amax per head] per layer], "v": ..., "source": ...}`` from calibration.json, or None."""
    path = Path(scales_dir) / "calibration.json"
    if not path.is_file():
        return None
    try:
        entries = _layer_entries(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError, TypeError):
        return None
    if not entries:
        return None
    out = {"k": [], "v": [], "source": "calibration.json", "quantity": "amax"}
    for e in entries:
        flat = _flat(e)
        for which in ("k", "v"):
            amax = _pick(flat, which, "amax")
            if amax is None:
                scale = _pick(flat, which, "scale")
                amax = [s * qmax for s in scale] if scale else None
            out[which].append(amax)
    if not any(out["k"]) and not any(out["v"]):
        return None
    return out


def layer_ranges(engine, scales_dir: str | None) -> dict | None:
    """The figure's data for one engine; ``None`` when no layer has static scales."""
    static = [
        (layer.spec, layer)
        for layer in engine.cache.layers
        if layer.spec.dtype.quantized and not layer.spec.dtype.dynamic
    ]
    if not static:
        return None
    qmax = static[0][0].dtype.qmax
    if scales_dir:
        got = read_calibration_json(scales_dir, qmax)
        if got is not None:
            return got
    out = {"k": [], "v": [], "source": "engine scale x qmax", "quantity": "amax"}
    for layer in engine.cache.layers:
        quantized = layer.spec.dtype.quantized and not layer.spec.dtype.dynamic
        for which, t in (("k", layer.k_scale), ("v", layer.v_scale)):
            out[which].append([float(x) * layer.spec.dtype.qmax for x in t.reshape(-1).tolist()] if quantized else None)
    return out
