"""Conversion: write a calibrated model directory (format described in calibrate/FORMAT.md).

* fp8: a compressed-tensors checkpoint vLLM loads as an fp8-KV model --
  ``config.json["quantization_config"]`` with ``kv_cache_scheme`` and fp32
  ``<attn>.k_scale`` / ``<attn>.v_scale`` tensors (``[1]`` per tensor,
  ``[num_kv_heads]`` per head) in ``kv_cache_scales.safetensors``.
* int8: vLLM has no static int8 KV cache, so the scales go in qkv's own section
  ``config.json["qkv_kv_cache"]`` and ``qkv_kv_scales.safetensors``.
* the per-token 4-bit modes: their clipping ratios (``<attn>.k_clip`` / ``v_clip``, one fp32 value per
  layer) in the qkv section and file; vLLM computes its per-token scales without ratios.
* qkv extensions (``channel`` scales, ``rotation: hadamard``): also only the qkv
  section, for fp8 too, because vLLM would load such scales without applying
  them correctly. Auto-skip's layers are recorded in the qkv section; an
  otherwise plain fp8 checkpoint keeps its compressed-tensors block.

The weights are hard-linked (copied across filesystems), copied or symlinked,
never changed; ``model.safetensors.index.json`` lists them (and the fp8 scales)
so loaders that follow the index see exactly those tensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qkv.kernels.quant import INT4_GRID
from qkv.model_loader import COMPENSATION_KEY
from qkv.scales import QKV_SCALES_FILE, QKV_SECTION

from .report import calibration_record, scale_convention
from .run import Calibration

__all__ = [
    "write_checkpoint",
    "kv_cache_scheme",
    "quantization_config",
    "FP8_SCALES_FILE",
    "INDEX_FILE",
    "attention_prefixes",
]

FP8_SCALES_FILE = "kv_cache_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CALIBRATION_FILE = "calibration.json"
_SCALE_NAME = re.compile(r"\.(k_scale|v_scale|kv_scale|q_scale|k_zero_point|v_zero_point|q_zero_point)$")
_ATTN = re.compile(r"^(.*\.layers\.(\d+)\.self_attn)\.k_proj\.weight$")
_NOT_COPIED = {INDEX_FILE, CALIBRATION_FILE, "recipe.yaml", QKV_SCALES_FILE, FP8_SCALES_FILE, "config.json"}


def kv_cache_scheme(strategy: str) -> dict:
    """compressed-tensors ``QuantizationArgs`` for a static fp8 KV cache, as its serializer writes them."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "attn_head" if strategy == "head" else "tensor",
        "dynamic": False,
    }


def quantization_config(strategy: str, existing: dict | None = None) -> dict:
    """A KV-only compressed-tensors ``QuantizationConfig`` (weights untouched), merged into ``existing``."""
    qc = {
        "config_groups": {},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": "dense",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": [],
    }
    if existing:
        qc.update(existing)
    qc["kv_cache_scheme"] = kv_cache_scheme(strategy)
    return qc


def _weight_files(src: Path) -> list[Path]:
    index = src / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src / n for n in names]
    return sorted(p for p in src.glob("*.safetensors") if p.name not in (QKV_SCALES_FILE, FP8_SCALES_FILE))


def _place(src: Path, dst: Path, mode: str) -> None:
    if mode == "symlink":
        os.symlink(src.resolve(), dst)
        return
    if mode == "link":
        try:
            os.link(src.resolve(), dst)
            return
        except OSError:  # another filesystem, or links not allowed: copy
            pass
    shutil.copy2(src, dst)


def _write_weights(src: Path, out: Path, mode: str) -> dict[str, str]:
    """Place every weight file in ``out``; returns the weight map (tensor name -> file).

    A file that already carries KV-scale tensors (an earlier calibration) is
    rewritten without them, so the new scales are the only ones.
    """
    weight_map: dict[str, str] = {}
    for f in _weight_files(src):
        with safe_open(str(f), framework="pt") as fh:
            names = list(fh.keys())
            stale = [n for n in names if _SCALE_NAME.search(n)]
            if stale:
                keep = {n: fh.get_tensor(n) for n in names if n not in stale}
                save_file(keep, str(out / f.name), metadata=fh.metadata() or {"format": "pt"})
                names = list(keep)
        if not stale:
            _place(f, out / f.name, mode)
        weight_map.update({n: f.name for n in names})
    if not weight_map:
        raise ValueError(f"{src}: no *.safetensors weights to copy")
    return weight_map


def attention_prefixes(weight_names, num_layers: int) -> dict[int, str]:
    """``{layer: "model.layers.N.self_attn"}`` as named in the checkpoint (multimodal ones nest deeper)."""
    found: dict[int, str] = {}
    for name in weight_names:
        m = _ATTN.match(name)
        if m and "vision" not in name:
            found.setdefault(int(m.group(2)), m.group(1))
    return {i: found.get(i, f"model.layers.{i}.self_attn") for i in range(num_layers)}


def _scale_tensors(cal: Calibration, prefixes: dict[int, str]) -> dict[str, torch.Tensor]:
    out = {}
    for c in cal.clips or []:
        out[f"{prefixes[c.layer]}.k_clip"] = torch.tensor([c.k_clip], dtype=torch.float32)
        out[f"{prefixes[c.layer]}.v_clip"] = torch.tensor([c.v_clip], dtype=torch.float32)
    for layer, basis in sorted((cal.bases or {}).items()):
        out[f"{prefixes[layer]}.k_mean"] = basis.mean.to(torch.float32).contiguous()
        out[f"{prefixes[layer]}.k_smooth"] = basis.smooth.to(torch.float32).contiguous()
    for r in cal.layers:
        shape = {"head": (r.num_kv_heads,), "channel": (r.num_kv_heads, -1)}.get(cal.strategy, (1,))
        out[f"{prefixes[r.layer]}.k_scale"] = r.k_scale.to(torch.float32).reshape(shape).contiguous()
        out[f"{prefixes[r.layer]}.v_scale"] = r.v_scale.to(torch.float32).reshape(shape).contiguous()
    return out


def vllm_readable(cal: Calibration) -> bool:
    """fp8 with tensor/head scales and no rotation: exactly what compressed-tensors can describe."""
    return cal.kind == "float" and cal.strategy in ("tensor", "head") and not cal.rotation


def _num_bits(cal: Calibration) -> int | str:
    """8, or for the 4-bit modes their K/V widths (``4`` or ``"8/4"``)."""
    dt = cal.kv_dtype
    if not dt.packed:
        return 8
    k, v = dt.side_bits(0), dt.side_bits(1)
    return 4 if k == v else f"{k}/{v}"


def qkv_section(cal: Calibration, scales_file: str) -> dict:
    return {
        "type": cal.kind,
        "num_bits": _num_bits(cal),
        "kv_cache_dtype": cal.kv_dtype.name,
        "strategy": cal.strategy,
        "symmetric": True,
        "dynamic": cal.kv_dtype.dynamic,
        "rotation": cal.rotation or "none",
        "skip_layers": list(cal.skip_layers or []),
        "skip_dtype": cal.skip_dtype,
        "scales_file": scales_file,
        "scale_dtype": "float32",
        "scale_convention": scale_convention(cal) + ("; on Hadamard-rotated K/V" if cal.rotation else ""),
        "format_version": 4,
        "vllm_readable": vllm_readable(cal),
        "calibration": CALIBRATION_FILE,
        **_grid(cal),
    }


def _config(src_config: dict, cal: Calibration) -> dict:
    cfg = dict(src_config)
    cfg.pop(QKV_SECTION, None)
    # a source's own record stays: its weights still carry the factors (export_folded refuses such a source)
    fold = cal.fold or {}
    comp = fold.get("rounding_compensation")
    if comp:  # qkv (and any engine that rounds to nearest) divides these out again: qkv.model_loader
        cfg[COMPENSATION_KEY] = {"target_rounding": fold["rounding"], "layers": comp}
    qc = cfg.get("quantization_config")
    if qc and qc.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"{cal.model}: its weights are quantized with {qc.get('quant_method')!r}; calibrate the unquantized model"
        )
    if vllm_readable(cal):
        cfg["quantization_config"] = quantization_config(cal.strategy, qc)
        if cal.skip_layers:
            cfg[QKV_SECTION] = qkv_section(cal, FP8_SCALES_FILE)
        return cfg
    if qc:  # int8 / extensions: a stale fp8 kv_cache_scheme must not survive
        qc = dict(qc, kv_cache_scheme=None)
        if qc.get("config_groups"):
            cfg["quantization_config"] = qc
        else:
            cfg.pop("quantization_config")
    cfg[QKV_SECTION] = qkv_section(cal, QKV_SCALES_FILE)
    return cfg


def write_scales_file(cal: Calibration, path: str | Path) -> Path:
    """Only the scales, as one self-describing ``.safetensors`` file (``--kv-scales FILE``)."""
    path = Path(path)
    save_file(_scale_tensors(cal, attention_prefixes([], cal.num_layers)), str(path), metadata=_file_meta(cal))
    return path


def _file_meta(cal: Calibration) -> dict[str, str]:
    """The scales file describes itself, so ``--kv-scales FILE`` works without the directory."""
    strategy = "attn_head" if cal.strategy == "head" and vllm_readable(cal) else cal.strategy
    return {
        "format": "pt",
        "type": cal.kind,
        "num_bits": str(_num_bits(cal)),
        "kv_cache_dtype": cal.kv_dtype.name,
        "strategy": strategy,
        "rotation": cal.rotation or "none",
        "skip_layers": ",".join(map(str, cal.skip_layers or [])),
        "skip_dtype": cal.skip_dtype,
        "scale_convention": scale_convention(cal),
        **_grid(cal),
    }


def _grid(cal: Calibration) -> dict[str, str]:
    """A 4-bit mode's grid, which its clipping ratios were chosen for (the engine refuses ratios without it)."""
    return {"int4_grid": INT4_GRID} if cal.kv_dtype.packed else {}


def vllm_note(cal: Calibration) -> str:
    """Why vLLM cannot use these scales as they are (empty when it can)."""
    if cal.clips is not None:
        return (
            f"clipping ratios are a qkv extension: vLLM's {cal.kv_dtype.name} (where it has one) computes "
            "unclipped per-token scales"
            + ("; K's centring and smoothing (k_mean, k_smooth) are qkv's too" if cal.bases else "")
        )
    if cal.kind == "int":
        return "vLLM has no static int8 KV cache; it loads these weights but not the int8 scales"
    if cal.rotation:
        return (
            "the scales are of Hadamard-rotated K/V, a qkv extension: vLLM cannot rotate its cache, "
            "so these scales are qkv-only"
        )
    if cal.strategy == "channel":
        return (
            "per-channel scales are a qkv extension; `qkv export-vllm` reduces them to per-head "
            "(attn_head) scales vLLM reads"
        )
    return ""


def write_checkpoint(cal: Calibration, out: str | Path, weights: str = "link", overwrite: bool = False) -> Path:
    """Write the calibrated model directory ``out`` from ``cal.model_path``; returns ``out``."""
    if weights not in ("link", "copy", "symlink"):
        raise ValueError(f"--weights must be link, copy or symlink, got {weights!r}")
    src, out = Path(cal.model_path).resolve(), Path(out)
    if out.exists() and out.resolve() == src:
        raise ValueError(f"-o {out} is the model directory itself; choose a new directory")
    config = _config(json.loads((src / "config.json").read_text()), cal)  # may refuse: before any write
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"-o {out} exists and is not empty; pass --overwrite or choose a new directory")
        if not (out / CALIBRATION_FILE).exists():
            raise ValueError(
                f"-o {out}: --overwrite only replaces an earlier `qkv calibrate` output "
                f"(it has no {CALIBRATION_FILE}); choose a new directory"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
            shutil.copy2(f, out / f.name)
    weight_map = _write_weights(src, out, weights)
    num_layers = cal.num_layers
    tensors = _scale_tensors(cal, attention_prefixes(weight_map, num_layers))
    clash = sorted(set(tensors) & set(weight_map))
    if clash:
        raise ValueError(f"{src}: already has tensors named {clash[0]}")
    if vllm_readable(cal):
        save_file(tensors, str(out / FP8_SCALES_FILE), metadata=_file_meta(cal))
        weight_map.update({n: FP8_SCALES_FILE for n in tensors})
        output = {"format": "compressed-tensors", "scales_file": FP8_SCALES_FILE, "vllm_readable": True}
        if cal.skip_layers:
            output["note"] = (
                f"serve with vLLM as --kv-cache-dtype-skip-layers "
                f"{' '.join(map(str, cal.skip_layers))} (auto-skip's choice; vLLM does not read it"
                + (
                    f", and keeps them in the model's dtype, where qkv uses {cal.skip_dtype})"
                    if cal.skip_dtype != "auto"
                    else ")"
                )
            )
    else:
        save_file(tensors, str(out / QKV_SCALES_FILE), metadata=_file_meta(cal))
        output = {
            "format": f"qkv ({QKV_SECTION})",
            "scales_file": QKV_SCALES_FILE,
            "vllm_readable": False,
            "note": vllm_note(cal),
        }
    size = sum((out / n).stat().st_size for n in set(weight_map.values()))
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    record = calibration_record(cal, dict(output, weights=weights, path=str(out.resolve())))
    (out / CALIBRATION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out
