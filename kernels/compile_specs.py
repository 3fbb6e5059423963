"""The kernel specializations qkv launches, found by driving the real launchers in capture mode.

No constexpr is listed here: :func:`drive` calls ``triton_write`` and
``triton_attend`` (which also launches the split-KV merge) on small CPU tensors
inside :func:`.launch.capture` for one GPU architecture, and the launchers decide every
constexpr, tile and option exactly as they would on that GPU. A constexpr added to a
kernel is therefore checked as soon as a launcher passes it.

What is driven (the axes of the compile check):

* every cache dtype: bf16, fp16, fp32, fp8 e4m3 / e5m2, int8, and both per-token-head
  modes, with static per-tensor, per-head and per-channel scales where they apply;
* Hadamard rotation on and off, head_dim 64, 128 and 256;
* attention in three phases: a mixed prefill (prefill tiles), a short decode (decode
  tiles, one segment) and a 32k-token decode (split-KV plus the merge kernel).

Every (cache config, rotation, head_dim) is written and attended in one phase; the phase
and the secondary axes — GQA group 1..8, kv heads, sliding window on/off, query dtype,
block size — rotate over those combinations (a covering design: every value occurs,
many times and in different company) instead of multiplying them, so the check stays
within a CI budget; each combination is still a real launcher call.
"""

from __future__ import annotations

import itertools

import torch

from .launch import Launch, capture
from .paged import PagedLayer, StepMetadata
from .quant import resolve_cache_dtype
from .triton_attention import triton_attend
from .triton_cache_write import triton_write

__all__ = ["CACHE_CONFIGS", "HEAD_DIMS", "PHASES", "drive"]

# (cache dtype, static scale granularity); None = unquantized or dynamic
CACHE_CONFIGS: tuple[tuple[str, str | None], ...] = (
    ("bfloat16", None),
    ("float16", None),
    ("float32", None),
    ("fp8_e4m3", "tensor"),
    ("fp8_e4m3", "head"),
    ("fp8_e4m3", "channel"),
    ("fp8_e5m2", "head"),
    ("fp8_e5m2", "channel"),
    ("int8", "tensor"),
    ("int8", "head"),
    ("int8", "channel"),
    ("fp8_per_token_head", None),
    ("int8_per_token_head", None),
    ("int4_per_token_head", None),
    ("k8v4_per_token_head", None),
)
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
KV_HEADS = (8, 1, 2, 4)
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.bfloat16, torch.float32)
# (seq_lens, q_lens) per phase; the 32k decode makes several segments
PHASES = {
    "prefill": ([37, 300], [5, 300]),
    "decode": ([40, 77], [1, 1]),
    "split_decode": ([32768], [1]),
}
BLOCK_SIZES = (16, 16, 16, 32)  # the paged layout's block size (a constexpr); 16 is the default
WINDOW = 4096


def _scales(granularity: str | None, hkv: int, d: int) -> tuple[torch.Tensor | None, ...]:
    if granularity is None:
        return None, None
    shape = {"tensor": (1,), "head": (hkv,), "channel": (hkv, d)}[granularity]
    return torch.full(shape, 0.02), torch.full(shape, 0.01)


def _model_dtype(name: str, i: int) -> torch.dtype:
    """Unquantized caches hold the model dtype (``auto``); quantized ones rotate over model dtypes."""
    dt = resolve_cache_dtype(name)
    return dt.storage if not dt.quantized else MODEL_DTYPES[i % len(MODEL_DTYPES)]


def _layer(
    name: str, granularity: str | None, rotate: bool, d: int, hkv: int, bs: int, window: int | None = None
) -> PagedLayer:
    dt = resolve_cache_dtype(name)
    k_scale, v_scale = _scales(granularity, hkv, d)
    cache = torch.zeros(dt.cache_shape(4, bs, hkv, d), dtype=dt.storage)  # never read: nothing runs
    scale_cache = torch.zeros(4, 2, bs, hkv) if dt.dynamic else None
    return PagedLayer(cache, dt, k_scale, v_scale, scale_cache, rotate, window)


def _write(name: str, granularity: str | None, rotate: bool, d: int, hkv: int, i: int) -> None:
    layer = _layer(name, granularity, rotate, d, hkv, BLOCK_SIZES[i % len(BLOCK_SIZES)])
    key = torch.zeros(3, hkv, d, dtype=_model_dtype(name, i))
    meta = StepMetadata.build([0, 5, -1], [[0]], [3], [0, 3])
    triton_write(layer, key, key, meta)


def _attend(
    name: str,
    granularity: str | None,
    rotate: bool,
    d: int,
    hkv: int,
    group: int,
    phase: str,
    window: int | None,
    i: int,
) -> None:
    seq_lens, q_lens = PHASES[phase]
    bs = BLOCK_SIZES[(i // 2) % len(BLOCK_SIZES)]
    layer = _layer(name, granularity, rotate, d, hkv, bs, window)
    max_blocks = -(-max(seq_lens) // bs)
    query = torch.zeros(sum(q_lens), hkv * group, d, dtype=_model_dtype(name, i))
    qsl = [0, *itertools.accumulate(q_lens)]
    meta = StepMetadata.build([0] * qsl[-1], [[0] * max_blocks] * len(seq_lens), seq_lens, qsl)
    triton_attend(layer, query, meta, d**-0.5)


def drive(arch: int) -> list[Launch]:
    """Every launch the driven configurations make when compiled for ``arch`` (duplicates included).

    Each (cache config, rotation, head_dim) writes once and attends in one phase, the
    phase rotating so that every cache config meets every phase (over its head_dims)
    and every head_dim meets every phase; fp32 queries and sliding windows ride along.
    """
    with capture(arch) as launches:
        for i, ((c, (name, granularity)), (r, rotate), (h, d)) in enumerate(
            itertools.product(enumerate(CACHE_CONFIGS), enumerate((False, True)), enumerate(HEAD_DIMS))
        ):
            _write(name, granularity, rotate, d, KV_HEADS[i % len(KV_HEADS)], i)
            phase = list(PHASES)[(c + r + h) % len(PHASES)]
            group = GROUPS[i % len(GROUPS)]
            hkv = KV_HEADS[(i // len(GROUPS)) % len(KV_HEADS)]
            window = WINDOW if (i // 3) % 2 else None
            _attend(name, granularity, rotate, d, hkv, group, phase, window, i)
    return launches
