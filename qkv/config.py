"""Engine options with vLLM's names, and the small parsers the CLI shares with the Python API."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .block_pool import DEFAULT_HASH_ALGO, HASH_ALGOS
from .options import option, validate_options

__all__ = ["EngineConfig", "option", "parse_size", "parse_skip_layers"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


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
                    f"--kv-cache-dtype-skip-layers takes 'sliding_window' or layer indices, got {v!r}"
                ) from None
    return sliding, idx


def _positive_size(value: int | str) -> None:
    try:
        size = parse_size(value)
    except ValueError:
        size = None
    if size is None or size <= 0:
        raise ValueError(f"must be a size > 0 in bytes or with a unit like 512MiB or 2GiB, got {value!r}")


def _power_of_two(value: int) -> None:
    if value & (value - 1):
        raise ValueError(f"must be a power of two, got {value}")


def _device(value: str) -> None:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ValueError(f"must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")


def _skip_layers(value) -> None:
    _, idx = parse_skip_layers(value)
    if any(i < 0 for i in idx):
        raise ValueError(f"must hold layer indices >= 0, got {min(idx)}")


# The owning modules below import torch (and transformers): imported when a field is checked or a parser built,
# so that `import qkv.config` stays light.
def _skip_dtype(value: str) -> None:
    from .layer_specs import check_skip_dtype

    check_skip_dtype(value)


def _kv_cache_dtype(value: str) -> None:
    from .kernels.quant import resolve_cache_dtype

    resolve_cache_dtype(value)


def _kv_cache_dtype_help() -> str:
    from .kernels.quant import CACHE_DTYPE_NAMES

    return f"KV-cache storage dtype: {', '.join(CACHE_DTYPE_NAMES)} (fp8 = fp8_e4m3; auto: the model's dtype)"


def _exists(value: str) -> None:
    if not Path(value).exists():
        raise ValueError(f"must name an existing file or directory, got {value!r}")


def _positive_gib(value: float | int) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a size in GiB > 0 (vLLM's unit; 0.5 = 512 MiB), got {value!r}")


def _offloading_backend(value: str) -> None:
    from .offload import OFFLOADING_BACKENDS

    if value not in OFFLOADING_BACKENDS:
        extra = " (vLLM's lmcache backend is not supported by qkv)" if value == "lmcache" else ""
        raise ValueError(f"must be one of {', '.join(OFFLOADING_BACKENDS)}{extra}; got {value!r}")


def _directory(value: str) -> None:
    if Path(value).exists() and not Path(value).is_dir():
        raise ValueError(f"must be a directory (it is created if missing), got the file {value!r}")


def _model_dtypes() -> tuple[str, ...]:
    from .model_loader import _DTYPES

    return ("auto", *_DTYPES)


def _rotations() -> tuple[str, ...]:
    from .kernels.quant import ROTATIONS

    return ("auto", *ROTATIONS)


def _cpu_matmul_dtypes() -> tuple[str, ...]:
    from .cpu_linear import CPU_MATMUL_DTYPES

    return CPU_MATMUL_DTYPES


def _attention_backends() -> tuple[str, ...]:
    from .attention import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS


DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither memory nor num_blocks is given


@dataclass
class EngineConfig:
    """Engine options with vLLM's names, each validated (type, range, choices) when the object is built.

    Every error names the field, and comes before a model is loaded. The field
    metadata (:func:`option`) holds what a command-line flag needs, so the
    flags can be generated from this class.
    """

    model: str = option(help="registry name (e.g. smollm2-135m, gemma3-270m) or a local Hugging Face directory")
    dtype: str = option("auto", "model dtype (auto: the checkpoint's)", choices=_model_dtypes)
    kv_cache_dtype: str = option("auto", _kv_cache_dtype_help, check=_kv_cache_dtype)
    kv_scales: str | None = option(None, "calibrated checkpoint dir or scales file (qkv calibrate -o)", check=_exists)
    kv_cache_dtype_skip_layers: list[str | int] | str | None = option(
        None,
        "keep these layers' cache unquantized: 'sliding_window' and/or layer indices (default: the layers "
        "a calibrated checkpoint's auto-skip chose, else none)",
        check=_skip_layers,
    )
    kv_cache_dtype_skip_dtype: str | None = option(
        None,
        "qkv extension: the cache dtype of the skipped layers: auto (the model's, as vLLM keeps them), or "
        "int8_per_token_head / fp8_per_token_head (half the bytes, no scales to calibrate). Default: what a "
        "calibrated checkpoint's auto-skip chose, else auto",
        check=_skip_dtype,
    )
    kv_rotation: str = option(
        "auto",
        "qkv extension: Hadamard-rotate K/V along head_dim before quantizing "
        "(auto: whatever the scales were calibrated with)",
        choices=_rotations,
    )
    block_size: int = option(16, "tokens per KV block", ge=1, check=_power_of_two)
    kv_cache_memory: int | str | None = option(
        None, f"bytes for the KV cache, e.g. 2GiB (default {DEFAULT_KV_CACHE_MEMORY >> 30}GiB)", check=_positive_size
    )
    num_blocks: int | None = option(
        None, "number of KV blocks, the null block included (overrides kv_cache_memory)", ge=2
    )
    max_model_len: int | None = option(
        None, "longest prompt + output (default: the model's, capped by the cache)", ge=1
    )
    max_num_seqs: int = option(64, "most requests running at once", ge=1)
    max_num_batched_tokens: int = option(2048, "most tokens in one step", ge=1)
    enable_prefix_caching: bool = option(True, "automatic prefix caching")
    prefix_caching_hash_algo: str = option(
        DEFAULT_HASH_ALGO,
        "hash of prefix-cache blocks (vLLM's flag); a "
        "cryptographic hash, so that no client can make its blocks collide "
        "with another's",
        choices=HASH_ALGOS,
    )
    attention_backend: str | None = option(
        None,
        "default: triton on CUDA; on a CPU the fused cpu kernels "
        "(compiled on first use), "
        "or the torch reference when no C++ compiler is found",
        choices=_attention_backends,
    )
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)", check=_device)
    # Not read by the engine (a request's seed is SamplingParams.seed); qkv eval passes its own seed here.
    seed: int = option(0, "seed of whoever drives the engine (evaluation, calibration)")
    batch_invariant: bool = option(
        False,
        "row-invariant GEMMs (fixed-shape tiles, or on a CPU qkv's few-row kernel where it computes the "
        "linears' arithmetic) and (on the cpu backend) row-invariant attention: a request's tokens do not "
        "depend on what it is batched with, how its prefill is chunked or prefix-cache hits (slower)",
    )
    compile_model: bool = option(
        False,
        "qkv extension: compile the model's decoder with torch.compile (inductor), attention and linears as "
        "opaque ops, before the first request (about a minute the first time, cached on disk after); faster, "
        "not bit-identical to transformers; falls back to eager with a warning where it cannot build",
    )
    cpu_matmul_dtype: str = option(
        "auto",
        "qkv extension: what a 16-bit model's linear layers multiply in on a CPU: float32 (exact upcasts, "
        "one rounding back; several times faster where the CPU has no bf16/fp16 matrix instructions), "
        "model (the weights' own dtype, as transformers does), auto (float32 on such CPUs, else model)",
        choices=_cpu_matmul_dtypes,
    )
    kv_offloading_size: float | int | None = option(
        None,
        "GiB for a second tier of prefix blocks: blocks the device pool evicts go there and come back "
        "on a hit (vLLM's flag); default: no tier",
        check=_positive_gib,
    )
    kv_offloading_backend: str = option(
        "native", "offload backend: native (vLLM's lmcache is not supported)", check=_offloading_backend
    )
    kv_offloading_dir: str | None = option(
        None,
        "qkv extension: back the offload tier with files in this directory, so it survives restarts",
        check=_directory,
    )

    DEFAULT_KV_CACHE_MEMORY = DEFAULT_KV_CACHE_MEMORY

    def __post_init__(self) -> None:
        for name in ("model", "kv_scales", "kv_offloading_dir"):  # paths are welcome where a path is meant
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field whose type, range or value is wrong."""
        validate_options(self)
        if not self.model:
            raise ValueError("model must be a registry name or a directory, got ''")
        if self.compile_model and self.batch_invariant:
            raise ValueError(
                "compile_model and batch_invariant exclude each other: the compiled forward fuses operations "
                "in an order of its own, so it cannot keep --batch-invariant's row-for-row arithmetic"
            )
        if self.kv_offloading_dir is not None and self.kv_offloading_size is None:
            raise ValueError("kv_offloading_dir needs kv_offloading_size: the tier's cap in GiB")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching: the tier is keyed by prefix-cache block hashes")
