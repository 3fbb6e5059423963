"""The paged-cache scenario every kernel test builds on: a shuffled cache holding each sequence's context.

One builder instead of one per test file. The cache's unused slots and unused blocks hold bytes that decode
to NaN (garbage for int8), so a kernel that reads past a sequence's length, or before its window, fails
loudly; block tables are shuffled and padded with out-of-range ids past each sequence's blocks. The
reference writes the contexts, so every back end attends over the same bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from qkv.kernels import reference
from qkv.kernels.paged import PagedLayer, StepMetadata
from qkv.kernels.quant import resolve_cache_dtype

__all__ = ["STALE_BYTES", "Scenario", "bits", "context_slots", "paged_scenario", "static_scales", "write_step"]

STALE_BYTES = {1: (0x7F, 0xFF), 2: (0xFF, 0x7F), 4: (0xFF, 0xFF)}  # NaN in fp8/bf16/fp32; -1 garbage in int8
PAD_BLOCK = 10_000  # block-table entries past a sequence's blocks: out of range, so reading one would fault


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t``, for bit-exact comparisons that treat NaN payloads as values."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def static_scales(name: str, granularity: str | None, hkv: int, d: int, g: torch.Generator):
    """Random static scales of a granularity (``tensor``, ``head``, ``channel``), sized for unit-variance inputs;
    ``(None, None)`` for unquantized and dynamic caches."""
    dt = resolve_cache_dtype(name)
    if not dt.quantized or dt.dynamic or granularity is None:
        return None, None
    base = 0.02 if dt.kind == "float" else 0.04
    shape = {"tensor": (1,), "head": (hkv,), "channel": (hkv, d)}[granularity]
    return torch.rand(shape, generator=g) * base + base / 2, torch.rand(shape, generator=g) * base + base / 2


def context_slots(tables: torch.Tensor, seq: int, start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions ``[start, end)`` of sequence ``seq``."""
    return [int(tables[seq, p // block_size]) * block_size + p % block_size for p in range(start, end)]


def write_step(slots, device: torch.device | str = "cpu") -> StepMetadata:
    """A step that only writes: its tokens go to ``slots`` (``-1``: not written), as one sequence's queries."""
    slots = [int(s) for s in slots]
    return StepMetadata.build(slots, [[0]], [len(slots)], [0, len(slots)], device=device)


@dataclass
class Scenario:
    """A layer, a step over it, and the step's queries."""

    layer: PagedLayer
    query: torch.Tensor
    meta: StepMetadata
    sm_scale: float
    tables: torch.Tensor  # the block tables, on the host
    seq_lens: list[int]
    q_lens: list[int]

    def on(self, device: torch.device | str) -> Scenario:
        """The same scenario with every tensor copied to ``device`` (the cache too: writes stay separate)."""
        layer = self.layer

        def mv(t):
            return None if t is None else t.clone().to(device)

        moved = PagedLayer(
            mv(layer.kv),
            layer.dt,
            mv(layer.k_scale),
            mv(layer.v_scale),
            mv(layer.scale_cache),
            layer.rotate,
            layer.sliding_window,
        )
        return replace(self, layer=moved, query=self.query.to(device), meta=self.step(device=device))

    def step(self, chunks: list[tuple[int, int, int]] | None = None, device=None) -> StepMetadata:
        """Metadata for query ``chunks`` ``(sequence, first position, end position)`` (default: this step's)."""
        if chunks is None:
            chunks = [(s, n - q, n) for s, (n, q) in enumerate(zip(self.seq_lens, self.q_lens))]
        slots = [x for s, a, b in chunks for x in context_slots(self.tables, s, a, b, self.layer.block_size)]
        qsl = [0, *itertools.accumulate(b - a for _, a, b in chunks)]
        return StepMetadata.build(
            slots,
            self.tables[[s for s, _, _ in chunks]],
            [b for _, _, b in chunks],
            qsl,
            device=device or self.layer.kv.device,
        )

    def with_window(self, window: int | None) -> Scenario:
        return replace(self, layer=replace(self.layer, sliding_window=window))


def paged_scenario(
    name: str,
    seq_lens: list[int],
    q_lens: list[int],
    *,
    hq: int = 8,
    hkv: int = 2,
    d: int = 64,
    granularity: str | None = "head",
    rotate: bool = False,
    window: int | None = None,
    block_size: int = 16,
    q_dtype: torch.dtype = torch.float32,
    stale: tuple[int, int] | None = None,
    hot_channel: bool = False,
    extra_blocks: int = 3,
    seed: int = 0,
) -> Scenario:
    """Sequences of ``seq_lens`` context tokens, the last ``q_lens`` of which are this step's queries.

    ``stale`` overrides the byte pair every unused slot holds; ``hot_channel`` makes channel 5 of K twenty
    times larger (the outliers real keys have, which rotation and per-channel scales are for).
    """
    dt = resolve_cache_dtype(name)
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks  # a few blocks nobody owns
    shape = dt.cache_shape(num_blocks, block_size, hkv, d)
    raw = torch.empty(torch.Size(shape).numel() * dt.itemsize, dtype=torch.uint8)
    raw[0::2], raw[1::2] = stale or STALE_BYTES[dt.itemsize]
    kv = raw.view(dt.storage).view(shape)
    scale_cache = torch.full((num_blocks, 2, block_size, hkv), float("nan")) if dt.dynamic else None
    k_scale, v_scale = static_scales(name, granularity, hkv, d, g)
    layer = PagedLayer(kv, dt, k_scale, v_scale, scale_cache, rotate, window)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 2), PAD_BLOCK, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        tables[s, : blocks_per_seq[s]] = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        key = torch.randn(n, hkv, d, generator=g)
        if hot_channel:
            key[..., 5] *= 20
        value = torch.randn(n, hkv, d, generator=g)
        reference.write(
            layer, key, value, StepMetadata.build(context_slots(tables, s, 0, n, block_size), tables[[s]], [n], [0, n])
        )
    query = (torch.randn(sum(q_lens), hq, d, generator=g) * 2).to(q_dtype)
    sc = Scenario(layer, query, None, d**-0.5, tables, list(seq_lens), list(q_lens))  # type: ignore[arg-type]
    sc.meta = sc.step()
    return sc
