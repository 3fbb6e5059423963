"""Load a Hugging Face causal LM with qkv's paged attention, and describe its attention layers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from .attention import register

__all__ = [
    "COMPENSATION_KEY",
    "load_model",
    "load_tokenizer",
    "text_config",
    "attention_layout",
    "resolve_dtype",
    "undo_rounding_compensation",
]

logger = logging.getLogger(__name__)

# config.json key of an `export-vllm --fold --fold-rounding toward-zero` checkpoint: per layer and kv head, the
# factors folded into q_proj's rows and o_proj's input columns (qkv.calibrate.rounding)
COMPENSATION_KEY = "qkv_rounding_compensation"

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (bf16 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(d, str):
            d = _DTYPES.get(d, torch.bfloat16)
        return d if isinstance(d, torch.dtype) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, bfloat16, float16 or float32")
    return _DTYPES[dtype]


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """Multimodal configs (e.g. Gemma 3) keep the decoder's fields in ``text_config``."""
    return getattr(config, "text_config", None) or config


def load_tokenizer(path: str | Path):
    return AutoTokenizer.from_pretrained(str(path))


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, attn_implementation: str | None = None
) -> torch.nn.Module:
    """Instantiate transformers' own model class with ``attn_implementation="qkv_paged"``."""
    impl = attn_implementation or register()
    config = AutoConfig.from_pretrained(str(path))
    # A calibrated checkpoint carries compressed-tensors' kv_cache_scheme; the weights are plain, and
    # qkv reads the scales itself (qkv.scales), so transformers must not look for a quantizer.
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype, attn_implementation=impl)
    comp = getattr(config, COMPENSATION_KEY, None)
    if comp:
        undo_rounding_compensation(model, comp)
        logger.warning(
            "%s: undid the %s rounding compensation of this `export-vllm --fold` checkpoint (it suits a back "
            "end that rounds its fp8 cache that way; qkv rounds to nearest)",
            path,
            comp.get("target_rounding"),
        )
    return model.to(device).eval()


def undo_rounding_compensation(model: torch.nn.Module, comp: dict) -> None:
    """Divide out the factors an ``export-vllm --fold`` folded into each layer's ``q_proj`` rows and
    ``o_proj`` input columns for a back end that rounds its fp8 cache toward zero.

    Such a back end shrinks the cached K and V, and the factors undo that there; an engine that rounds to
    nearest would see them as a bias of a few percent on every score and attention output. The weights come
    back to within one rounding of the original ones (each was rounded to its dtype once more)."""
    cfg = text_config(model.config)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = comp.get("layers") or {}
    mods = _attention_modules(model)
    if sorted(layers, key=int) != [str(m.layer_idx) for m in mods]:
        raise ValueError(f"{COMPENSATION_KEY} in config.json names layers {sorted(layers, key=int)}, not the model's")
    with torch.no_grad():
        for m in mods:
            q_proj, o_proj = cast(torch.nn.Linear, m.q_proj), cast(torch.nn.Linear, m.o_proj)
            d = q_proj.out_features // hq
            ck, cv = (torch.tensor(layers[str(m.layer_idx)][kv], dtype=torch.float32) for kv in "kv")
            if ck.numel() != hkv or cv.numel() != hkv:
                raise ValueError(f"{COMPENSATION_KEY}: layer {m.layer_idx} needs {hkv} factors for K and for V")
            rows = ck.repeat_interleave(hq // hkv * d)
            q_proj.weight.copy_(q_proj.weight.float() / rows[:, None])
            if q_proj.bias is not None:
                q_proj.bias.copy_(q_proj.bias.float() / rows)
            o_proj.weight.copy_(o_proj.weight.float() / cv.repeat_interleave(hq // hkv * d)[None, :])


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


def attention_layout(model: torch.nn.Module) -> list[dict]:
    """Per layer: ``num_kv_heads``, ``head_dim`` and ``sliding_window`` (``None`` for full attention).

    Where the module itself names its window (Gemma 3, Qwen2/3) that wins;
    otherwise ``config.layer_types``, and for Mistral-style configs a global
    ``sliding_window`` applies to every layer, as transformers passes it.
    """
    cfg = text_config(model.config)
    layer_types = getattr(cfg, "layer_types", None)
    out = []
    for m in _attention_modules(model):
        i = m.layer_idx
        if hasattr(m, "sliding_window"):
            window = m.sliding_window
        elif layer_types:
            window = cfg.sliding_window if layer_types[i] == "sliding_attention" else None
        else:
            window = getattr(cfg, "sliding_window", None)
        head_dim = (
            getattr(m, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        out.append(
            {"layer_idx": i, "num_kv_heads": cfg.num_key_value_heads, "head_dim": head_dim, "sliding_window": window}
        )
    if [d["layer_idx"] for d in out] != list(range(cfg.num_hidden_layers)):
        raise ValueError("could not find one attention module per layer in this model")
    return out


def load_config(path: str | Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(path))
