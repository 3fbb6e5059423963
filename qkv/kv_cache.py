"""KV tensors per layer, allocated once, and the capacity arithmetic behind them.

Every layer has its own storage dtype and scales (skipped layers stay BF16),
so capacity is planned from per-layer bytes per token:
``2 * num_kv_heads * head_dim * itemsize`` (+ ``2 * num_kv_heads * 4`` bytes
of scales for the dynamic per-token-head modes; half or three quarters of the
value bytes for the packed 4-bit modes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kernels.paged import PagedLayer
from .kernels.quant import CacheDtype
from .key_basis import KeyBasis

__all__ = ["LayerSpec", "LayerCache", "KVCache", "plan_num_blocks", "capacity_line"]


@dataclass(frozen=True)
class LayerSpec:
    """Static facts about one attention layer's cache."""

    layer_idx: int
    num_kv_heads: int
    head_dim: int
    dtype: CacheDtype
    sliding_window: int | None = None
    rotation: str | None = None  # "hadamard": the cache holds K H and V H (qkv extension)

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * self.dtype.bytes_per_head(self.head_dim)


@dataclass(eq=False)
class LayerCache(PagedLayer):
    """One layer's paged cache (:class:`~qkv.kernels.paged.PagedLayer`, checked once when built) and its spec.

    ``kv`` is ``[num_blocks, 2, block_size, Hkv, D]`` (packed 4-bit dtypes: ``[num_blocks, planes, block_size,
    Hkv, D / 2]`` bytes, :mod:`qkv.kernels.paged`); static ``k_scale``/``v_scale`` are fp32 ``[Hkv]`` (or
    ``[Hkv, D]`` per channel); ``scale_cache`` is ``[num_blocks, 2, block_size, Hkv]`` fp32 (dynamic modes).
    """

    spec: LayerSpec = field(kw_only=True)
    key_basis: KeyBasis | None = field(default=None, kw_only=True)  # calibrated 4-bit caches (qkv.key_basis)


def bytes_per_block(specs: list[LayerSpec], block_size: int) -> int:
    return block_size * sum(s.bytes_per_token for s in specs)


def plan_num_blocks(specs: list[LayerSpec], block_size: int, kv_cache_memory: int) -> int:
    """How many blocks (null block included) fit in ``kv_cache_memory`` bytes."""
    n = kv_cache_memory // bytes_per_block(specs, block_size)
    if n < 2:
        raise ValueError(
            f"--kv-cache-memory {kv_cache_memory} B holds {n} blocks of "
            f"{bytes_per_block(specs, block_size)} B; need at least 2"
        )
    return int(n)


class KVCache:
    """All layers' cache tensors; block ids are shared by every layer."""

    def __init__(
        self,
        specs: list[LayerSpec],
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        clips: dict[int, tuple[float, float]] | None = None,
        bases: dict[int, KeyBasis] | None = None,
    ) -> None:
        """``scales``: static scales per layer index; ``clips``: calibrated ``(k_clip, v_clip)`` of dynamic
        layers (1.0 where absent); ``bases``: key bases per layer index (none where absent; calibration puts one on
        its BF16 cache too, where it changes roundings only)."""
        self.specs = specs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: list[LayerCache] = []
        for s in specs:
            shape = s.dtype.cache_shape(num_blocks, block_size, s.num_kv_heads, s.head_dim)
            kv = torch.zeros(shape, dtype=s.dtype.storage, device=device)
            scale_cache = k_scale = v_scale = None
            if s.dtype.dynamic:
                scale_cache = torch.ones(num_blocks, 2, block_size, s.num_kv_heads, dtype=torch.float32, device=device)
            elif s.dtype.quantized:
                k_scale, v_scale = (scales or {}).get(s.layer_idx, (torch.ones(1), torch.ones(1)))
            k_clip, v_clip = (clips or {}).get(s.layer_idx, (1.0, 1.0)) if s.dtype.dynamic else (1.0, 1.0)
            layer = LayerCache(
                kv,
                s.dtype,
                k_scale,
                v_scale,
                scale_cache,
                s.rotation is not None,
                s.sliding_window,
                k_clip,
                v_clip,
                spec=s,
                key_basis=bases[s.layer_idx].to(device) if bases and s.layer_idx in bases else None,
            )
            self.layers.append(layer)

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.specs)

    @property
    def num_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            total += layer.kv.numel() * layer.kv.element_size()
            if layer.scale_cache is not None:
                total += layer.scale_cache.numel() * 4
        return total

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` onto ``dst[i]`` in every layer: K/V bytes and the per-token-head scales.

        Copy-on-write for parallel sampling: a sample about to write into a
        partly filled block it shares with its siblings gets a private copy
        first. The bytes are copied as bytes (a uint8 view), so every cache
        dtype is copied exactly; all sources are read before any destination
        is written. Static scales are per layer, not per block: nothing to copy.
        """
        if not src:
            return
        device = self.layers[0].kv.device if self.layers else "cpu"
        s = torch.tensor(src, dtype=torch.long, device=device)
        d = torch.tensor(dst, dtype=torch.long, device=device)
        for layer in self.layers:
            raw = layer.kv.view(torch.uint8)
            raw.index_copy_(0, d, raw.index_select(0, s))
            if layer.scale_cache is not None:
                layer.scale_cache.index_copy_(0, d, layer.scale_cache.index_select(0, s))

    def dtype_summary(self) -> str:
        """e.g. ``fp8_e4m3 x26 + bfloat16 x4`` for a cache with skipped layers (``+hadamard`` when rotated,
        ``+key-basis`` with a calibrated key basis)."""
        counts: dict[str, int] = {}
        for s, layer in zip(self.specs, self.layers):
            name = s.dtype.name + ("+hadamard" if s.rotation else "") + ("+key-basis" if layer.key_basis else "")
            counts[name] = counts.get(name, 0) + 1
        return " + ".join(f"{k} x{v}" for k, v in counts.items())


def capacity_line(cache: KVCache, max_model_len: int) -> str:
    """vLLM-style capacity report: blocks, tokens, and maximum concurrency at max_model_len."""
    usable = cache.num_blocks - 1
    tokens = usable * cache.block_size
    blocks_per_seq = -(-max_model_len // cache.block_size)
    return (
        f"KV cache: {usable:,} blocks x {cache.block_size} tokens = {tokens:,} tokens "
        f"({cache.dtype_summary()}, {cache.bytes_per_token:,} B/token, "
        f"{cache.num_bytes / 2**20:,.1f} MiB); maximum concurrency for {max_model_len:,} tokens "
        f"per request: {usable / blocks_per_seq:.2f}x"
    )
