"""``qkv export-vllm SRC -o OUT``: turn a qkv-calibrated checkpoint into one vLLM serves as it is.

vLLM reads fp8 ``kv_cache_scheme`` scales per tensor or per head (``attn_head``)
and nothing else, so:

* fp8 ``tensor`` / ``head`` scales pass through unchanged;
* fp8 ``channel`` scales are **reduced to per-head**: each head's scale becomes
  the largest of its channel scales, which is exactly the per-head minmax scale
  of the same data, so nothing that fit before saturates now;
* scales of **Hadamard-rotated** K/V are refused: vLLM cannot rotate its cache,
  and those scales do not describe unrotated K/V;
* **int8** scales are refused: vLLM has no static int8 KV cache.

Auto-skip's layers stay recorded, and the command prints the
``--kv-cache-dtype-skip-layers`` flags that reproduce them in vLLM.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from qkv.model_loader import COMPENSATION_KEY, load_config, text_config
from qkv.registry import resolve_model
from qkv.scales import read_kv_scales

from .checkpoint import write_checkpoint
from .data import load_rows
from .fold import fold_weights
from .rounding import ROUNDINGS, compensation
from .run import Calibration, LayerResult, calibrate, resolve_target

__all__ = ["export_folded", "export_vllm"]


def _num_kv_heads(src: Path) -> int:
    cfg = text_config(load_config(src))
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def export_vllm(
    src: str | Path, out: str | Path, weights: str = "link", overwrite: bool = False
) -> tuple[Path, list[str]]:
    """Write ``out`` (a compressed-tensors fp8 checkpoint); returns it and the messages to print."""
    src = Path(src)
    scales = read_kv_scales(src)
    if scales is None:
        raise ValueError(f"{src} carries no KV-cache scales; calibrate it with `qkv calibrate` first")
    if scales.kind == "int":
        raise ValueError(
            f"{src} holds int8 scales: vLLM has no static int8 KV cache (use "
            f"--kv-cache-dtype int8_per_token_head there, or recalibrate with --kv-cache-dtype fp8)"
        )
    if scales.rotation:
        raise ValueError(
            f"{src} holds scales of {scales.rotation}-rotated K/V, a qkv extension vLLM cannot "
            f"apply: its cache stores unrotated K/V, for which these scales are wrong. Recalibrate "
            f"with `qkv calibrate --kv-rotation none` for vLLM"
        )
    notes = []
    strategy = scales.strategy
    heads = _num_kv_heads(src)
    dt = resolve_target("fp8", "head" if strategy == "channel" else strategy)
    layers = []
    for i in sorted(scales.k):
        k, v = scales.k[i].to(torch.float32), scales.v[i].to(torch.float32)
        if strategy == "channel":
            k, v = k.reshape(heads, -1).amax(dim=1), v.reshape(heads, -1).amax(dim=1)
        layers.append(LayerResult(i, heads, k * dt.qmax, v * dt.qmax, k, v, k * dt.qmax, v * dt.qmax, 0.0, 0.0))
    if strategy == "channel":
        notes.append(
            "reduced per-channel scales to per-head (attn_head): each head takes its largest channel "
            "scale, the per-head minmax of the same data; vLLM has no per-channel KV scales"
        )
        strategy = "head"
    cal = Calibration(
        model=str(src),
        model_path=src,
        kv_dtype=dt,
        strategy=strategy,
        observer={"observer": "exported", "from": str(src), "source_strategy": scales.strategy},
        layers=layers,
        samples_info={"source": f"exported from {src}"},
        num_samples=0,
        num_tokens=0,
        model_dtype="",
        seed=0,
        skip_layers=scales.skip_layers,
    )
    path = write_checkpoint(cal, out, weights=weights, overwrite=overwrite)
    if strategy == "head":
        notes.append("per-head scales need a vLLM attention backend that supports them (Flash Attention)")
    if scales.skip_layers:
        notes.append(
            "auto-skip kept layers in BF16; serve with vLLM as --kv-cache-dtype-skip-layers "
            + " ".join(map(str, scales.skip_layers))
        )
    return path, notes


def export_folded(
    src: str,
    out: str | Path,
    dataset: str | None,
    num_samples: int,
    seq_len: int,
    alpha: float = 0.0,
    overwrite: bool = False,
    rotate_v: bool = False,
    rounding: str | None = None,
) -> tuple[Path, list[str]]:
    """``--fold``: K smoothing (``alpha`` > 0) and the V rotation folded into ``src``'s weights (:mod:`.fold`),
    then per-tensor fp8 scales calibrated on the folded model, written as a plain compressed-tensors checkpoint.

    ``rounding="toward-zero"`` also folds the factors that undo a truncating back end's shrink of the cached
    K and V (:mod:`.rounding`), fitted at the exported scales; K and V themselves do not change with them, so
    the scales stay those of the folded model."""
    if dataset is None:
        raise ValueError("--fold needs --dataset: the smoothing and the scales come from calibration text")
    if rounding is None:
        raise ValueError(
            "--fold needs --fold-rounding: how the target back end rounds its fp8 cache writes (toward-zero for "
            "vLLM 0.32's CPU backend, eval/results/vllm/fp8_rounding.json; nearest for one that rounds to nearest)"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"--fold-rounding {rounding!r}: expected one of {', '.join(ROUNDINGS)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"-o {out} exists and is not empty; pass --overwrite or choose a new directory")
    model_dir = Path(resolve_model(src))
    if COMPENSATION_KEY in json.loads((model_dir / "config.json").read_text()):
        raise ValueError(
            f"{model_dir / 'config.json'} has {COMPENSATION_KEY}: this checkpoint is already folded for a back end's "
            "rounding; fold the original model instead"
        )
    # the same samples each time: per-channel K statistics for the smoothing, then the folded model's scales
    raw = load_rows(dataset)
    data: dict[str, Any] = dict(kv_cache_dtype="fp8", num_samples=num_samples, seq_len=seq_len)
    k_amax = None
    if alpha > 0:
        stats = calibrate(str(model_dir), raw=raw, progress=False, strategy="channel", **data)
        k_amax = {r.layer: r.k_observed_amax for r in stats.layers}
    with tempfile.TemporaryDirectory(prefix="qkv-fold-", dir=out.parent if out.parent.exists() else None) as tmp:
        folded = Path(tmp) / "folded"
        record = fold_weights(model_dir, folded, k_amax, alpha, rotate_v)
        cal = calibrate(str(folded), raw=raw, progress=False, strategy="tensor", **data)
        if rounding != "nearest":
            assert cal.stats is not None  # a static fp8 calibration keeps what it observed
            comp = {
                r.layer: (
                    compensation(cal.stats[r.layer, "k"], float(r.k_scale), rounding),
                    compensation(cal.stats[r.layer, "v"], float(r.v_scale), rounding),
                )
                for r in cal.layers
            }
            cal.model_path = Path(tmp) / "compensated"
            record = fold_weights(model_dir, cal.model_path, k_amax, alpha, rotate_v, comp)
        record["rounding"] = rounding
        cal.model, cal.fold = src, record
        write_checkpoint(cal, out, weights="copy", overwrite=overwrite)
    done = [f"K smoothing (alpha {alpha})" if k_amax else "", "the V Hadamard rotation" if rotate_v else ""]
    if rounding != "nearest":
        c = [x for r in record["rounding_compensation"].values() for x in r["k"] + r["v"]]
        done.append(f"{rounding} rounding compensation (factors {min(c):.4f}-{max(c):.4f})")
    notes = [
        f"folded {', '.join(x for x in done if x) or 'nothing'} into the weights of {record['layers']} layers; "
        f"per-tensor fp8 scales calibrated on the folded model ({num_samples} x {seq_len} tokens)"
    ]
    if rounding == "toward-zero":
        notes.append(
            "the rounding compensation suits a back end that rounds its fp8 cache toward zero (vLLM 0.32's CPU "
            "backend); one that rounds to nearest sees it as a bias (qkv divides it out on load)"
        )
    return out, notes
