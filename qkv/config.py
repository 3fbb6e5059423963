"""Engine options with vLLM's names, and the small parsers the CLI shares with the Python API."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["EngineConfig", "parse_size", "parse_skip_layers"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"2GiB"`` -> 2147483648; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; use bytes or a unit like 512MiB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_skip_layers(values: str | list[str | int] | None) -> tuple[bool, list[int]]:
    """``"sliding_window 0 5"`` / ``["sliding_window", 0]`` -> (skip sliding layers?, indices)."""
    if values is None:
        return False, []
    if isinstance(values, str):
        values = values.replace(",", " ").split()
    sliding, idx = False, []
    for v in values:
        if v == "sliding_window":
            sliding = True
        else:
            try:
                idx.append(int(v))
            except (TypeError, ValueError):
                raise ValueError(
                    f"--kv-cache-dtype-skip-layers takes 'sliding_window' or layer indices, got {v!r}") from None
    return sliding, idx


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_scales: str | None = None
    kv_cache_dtype_skip_layers: list[str | int] | str | None = None
    kv_rotation: str = "auto"   # qkv extension: auto (the scales' rotation) | none | hadamard
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    device: str | None = None
    seed: int = 0
    batch_invariant: bool = False
    extra: dict = field(default_factory=dict)

    DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither memory nor num_blocks is given

    def validate(self) -> None:
        from .kernels.quant import ROTATIONS, resolve_cache_dtype
        resolve_cache_dtype(self.kv_cache_dtype)  # unknown dtype: fail before loading anything
        parse_skip_layers(self.kv_cache_dtype_skip_layers)
        if self.kv_rotation not in ("auto", *ROTATIONS):
            raise ValueError(f"kv_rotation must be one of auto, {', '.join(ROTATIONS)}; got {self.kv_rotation!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
