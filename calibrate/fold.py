"""Fold qkv's K smoothing and V rotation into the weights, so that a stock engine with per-tensor scales gains.

A stock engine (vLLM) keeps one fp8 scale per layer for K and for V and cannot rotate its cache. Two changes
of basis make per-tensor scales fit better, and a third change undoes a back end's rounding bias; all three
live in the weights themselves:

* **V rotation** (exact): ``V' = V H`` per kv head (``H`` the normalized Hadamard matrix of size head_dim), from
  ``W_v' = H W_v`` (rows of each head); every query head's attention output is then ``O H``, undone by
  ``W_o' = W_o H`` on that head's input columns of ``o_proj``. A rotation spreads single-channel outliers over
  every channel, so one scale fits V.
* **K smoothing** (QServe's SmoothAttention): ``K' = K / s`` and ``Q' = Q s`` per kv head and channel, with
  ``s_c = max|K_c|^alpha`` normalized to a geometric mean of 1, and ``s_c = s_{c + d/2}``: RoPE rotates the
  pairs ``(c, c + d/2)``, and an equal scale on both commutes with it. ``q . k`` is unchanged; K's channel
  outliers shrink, so one scale fits K. Folded into ``k_proj``'s rows (``/ s``) and the rows of every query
  head of the group in ``q_proj`` (``* s``), biases alike. Models that normalize K per head (Qwen3's
  ``k_norm``, Gemma's) would undo a row scaling; they are refused.

* **Rounding compensation** (only for a named back end that rounds toward zero, :mod:`.rounding`): the query
  rows and ``o_proj``'s input columns of each kv head's group scaled by the factors that undo the back end's
  mean shrink of the cached K and V.

The first two are exact in real arithmetic; in bf16 weights they change rounding only. The statistics are those
``qkv calibrate`` observes (K after RoPE, per kv head and channel), and per-tensor scales are calibrated again
on the folded model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qkv.kernels.quant import hadamard_rotate

__all__ = ["fold_weights", "smoothing_scales"]


def smoothing_scales(k_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``[Hkv, D]`` K channel amax -> ``s`` with ``s_c = s_{c + D/2}`` and a geometric mean of 1 per head."""
    d = k_amax.shape[-1]
    pair = torch.maximum(k_amax[..., : d // 2], k_amax[..., d // 2 :]).clamp_min(1e-6)
    s = pair.float().pow(alpha)
    s = s / s.log().mean(-1, keepdim=True).exp()
    return torch.cat([s, s], dim=-1)


def _rotate_rows(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``H W`` for each head's block of ``d`` rows (``w`` is ``[heads * d, in]``)."""
    blocks = w.float().reshape(heads, d, -1)
    return hadamard_rotate(blocks.transpose(1, 2)).transpose(1, 2).reshape(heads * d, -1)


def _rotate_cols(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``W H`` for each head's block of ``d`` columns (``w`` is ``[out, heads * d]``)."""
    return hadamard_rotate(w.float().reshape(w.shape[0], heads, d)).reshape(w.shape[0], heads * d)


def fold_weights(
    src: Path,
    out: Path,
    k_amax: dict[int, torch.Tensor] | None,
    alpha: float = 0.5,
    rotate_v: bool = True,
    compensate: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict:
    """Write ``src``'s checkpoint to ``out`` with K smoothed (``k_amax[layer]``: ``[Hkv, D]``; ``None``: not
    smoothed) and V rotated.

    ``compensate[layer]`` (``[Hkv]`` factors for K and for V, :mod:`.rounding`) multiplies the query rows
    and the ``o_proj`` input columns of each kv head's group, in the same rewrite, so each weight is rounded
    to its dtype once. Returns what was folded, for the record (``calibration.json``)."""
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if any(k in str(text.get("model_type", "")) for k in ("qwen3", "gemma")):
        raise ValueError(
            f"--fold: {text.get('model_type')} normalizes K per head (k_norm), which undoes a folded "
            "smoothing; fold supports models whose K comes straight from k_proj (Llama, Qwen2, Mistral)"
        )
    hq, hkv = int(text["num_attention_heads"]), int(text.get("num_key_value_heads") or text["num_attention_heads"])
    d = int(text.get("head_dim") or text["hidden_size"] // hq)
    if d & (d - 1):
        raise ValueError(f"--fold: the Hadamard rotation needs a power-of-two head_dim, this model's is {d}")
    group = hq // hkv
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--fold: {src} has no .safetensors weights")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    done: dict[int, list[str]] = {}
    for f in files:
        tensors = load_file(str(f))
        for name in list(tensors):
            if ".self_attn." not in name or not name.startswith("model.layers."):
                continue
            layer = int(name.split(".")[2])
            t, dtype = tensors[name], tensors[name].dtype
            s = smoothing_scales(k_amax[layer], alpha) if k_amax else torch.ones(hkv, d)  # [Hkv, D]
            ck, cv = compensate[layer] if compensate else (torch.ones(hkv), torch.ones(hkv))
            if name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                new = t.float() / s.reshape(-1, *([1] * (t.dim() - 1)))
            elif name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                sq = (s * ck[:, None]).repeat_interleave(group, dim=0).reshape(-1, *([1] * (t.dim() - 1)))
                new = t.float() * sq
            elif rotate_v and name.endswith("v_proj.weight"):
                new = _rotate_rows(t, hkv, d)
            elif rotate_v and name.endswith("v_proj.bias"):
                new = hadamard_rotate(t.float().reshape(hkv, d)).reshape(-1)
            elif name.endswith("o_proj.weight") and (rotate_v or compensate):
                new = _rotate_cols(t, hq, d) if rotate_v else t.float()
                new = new * cv.repeat_interleave(group * d)[None, :]
            else:
                continue
            tensors[name] = new.to(dtype).contiguous()
            done.setdefault(layer, []).append(name.split(".self_attn.")[1])
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return {
        "k_smoothing": {"alpha": alpha, "pairs": "c, c + head_dim/2 (RoPE)"} if k_amax else None,
        "v_rotation": "hadamard" if rotate_v else None,
        "layers": len(done),
        "rounding_compensation": None
        if not compensate
        else {str(i): {"k": ck.tolist(), "v": cv.tolist()} for i, (ck, cv) in sorted(compensate.items())},
    }
