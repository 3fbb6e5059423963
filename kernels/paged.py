"""What every attention back end is handed: one layer's paged cache and one step's metadata.

Why one description for all: the torch reference, the CPU C++ kernels and the Triton kernels share one
cache layout and one set of rules (shapes, dtypes, scale granularities, rotation, windows). They are checked
here once, when a layer's cache is built (:class:`PagedLayer`), and a step's batch is described once, when
the runner builds the step (:class:`StepMetadata`). The per-layer path then does no validation and no host
synchronization: everything a launcher needs to know on the host (sequence lengths, the longest query, which
slots are written) was computed from the scheduler's Python lists before the forward began.

Layout (vLLM's Triton layout), one tensor per layer:

* ``kv``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in the layer's storage dtype; index 0 of
  dim 1 is K, index 1 is V. A *slot* is ``block_id * block_size + offset``; slot ``-1`` means "do not write".
* packed 4-bit dtypes (``int4_per_token_head``, ``k8v4_per_token_head``): ``kv`` is ``uint8 [num_blocks, P,
  block_size, num_kv_heads, head_dim / 2]``, dim 1 holding half-row *planes*: an int4 side takes one plane
  (channel ``j`` in byte ``j``'s low nibble, channel ``j + D/2`` in its high nibble), an int8 side two (its
  channels ``[0, D/2)``, then ``[D/2, D)``). K's planes come first: int4 has ``P = 2`` (vLLM's
  ``int4_per_token_head`` shape), k8v4 ``P = 3``. Every tile a kernel reads is then a run of contiguous
  bytes, and K and V can differ in size within one tensor per layer, so block copies, offload and the
  allocator treat every dtype alike.
* ``scale_cache`` (dynamic per-token-head modes only): ``[num_blocks, 2, block_size, num_kv_heads]`` fp32.
* static ``k_scale``/``v_scale`` (8-bit static modes only): fp32 ``[num_kv_heads]`` (a per-tensor scale is
  broadcast here, so one code path serves both compressed-tensors granularities) or ``[num_kv_heads,
  head_dim]`` for qkv's per-channel extension.
* ``rotate`` (``--kv-rotation hadamard``): the cache holds ``K H`` and ``V H``; attention rotates the query
  the same way and the output back.
* ``k_clip``/``v_clip`` (dynamic modes): the clipping ratio of the layer's per-token scales, ``scale = amax /
  qmax * clip`` (1.0 unless calibrated).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .quant import CacheDtype, check_rotation

__all__ = ["AttentionBackend", "PagedLayer", "StepMetadata", "check_kv", "check_query"]


def _static_scale(name: str, scale: torch.Tensor, num_kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """``[]``/``[1]``/``[Hkv]`` -> contiguous fp32 ``[Hkv]``; a per-channel ``[Hkv, D]`` stays 2-D."""
    s = torch.as_tensor(scale).to(device=device, dtype=torch.float32)
    if s.dim() == 2:
        if tuple(s.shape) != (num_kv_heads, head_dim):
            raise ValueError(
                f"per-channel {name} must be [num_kv_heads={num_kv_heads}, head_dim={head_dim}], got {tuple(s.shape)}"
            )
        return s.contiguous()
    if s.numel() not in (1, num_kv_heads):
        raise ValueError(f"{name} must have shape [num_kv_heads={num_kv_heads}] (or one element), got {tuple(s.shape)}")
    return s.reshape(-1).expand(num_kv_heads).contiguous()


@dataclass(eq=False)
class PagedLayer:
    """One attention layer's paged cache and how to read it, checked once at construction.

    ``eq=False``: a layer is an identity (back ends key prepared descriptors on it), not a value.
    """

    kv: torch.Tensor
    dt: CacheDtype
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    scale_cache: torch.Tensor | None = None
    rotate: bool = False
    sliding_window: int | None = None
    k_clip: float = 1.0
    v_clip: float = 1.0

    def __post_init__(self) -> None:
        kv, dt = self.kv, self.dt
        if kv.dim() != 5 or kv.shape[1] != dt.planes:
            dims = f"{dt.planes}, block_size, Hkv, D / 2" if dt.packed else "2, block_size, Hkv, D"
            raise ValueError(f"a {dt.name} kv_cache must be [num_blocks, {dims}], got {tuple(kv.shape)}")
        for name, clip in (("k_clip", self.k_clip), ("v_clip", self.v_clip)):
            if not 0.0 < clip <= 1.0 or (clip != 1.0 and not dt.dynamic):
                raise ValueError(f"{name} must be in (0, 1], and 1.0 unless the dtype is per-token, got {clip}")
        if kv.dtype != dt.storage:
            raise ValueError(f"kv_cache dtype {kv.dtype} does not match {dt.name} storage {dt.storage}")
        if kv.stride(-1) != 1:
            raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.rotate:
            check_rotation("hadamard", self.head_dim)
        if dt.dynamic:
            expected = (self.num_blocks, 2, self.block_size, self.num_kv_heads)
            sc = self.scale_cache
            if sc is None or tuple(sc.shape) != expected or sc.dtype != torch.float32:
                raise ValueError(f"{dt.name} needs a float32 scale_cache of shape {expected}")
            if sc.stride(-1) != 1 or sc.device != kv.device:
                raise ValueError("scale_cache must be on kv_cache's device and contiguous in its last dimension")
            self.k_scale = self.v_scale = None
        elif dt.quantized:
            if self.k_scale is None or self.v_scale is None:
                raise ValueError(f"{dt.name} needs k_scale and v_scale")
            k = _static_scale("k_scale", self.k_scale, self.num_kv_heads, self.head_dim, kv.device)
            v = _static_scale("v_scale", self.v_scale, self.num_kv_heads, self.head_dim, kv.device)
            if k.dim() != v.dim():
                raise ValueError(f"k_scale and v_scale must have the same granularity, got {k.shape} and {v.shape}")
            self.k_scale, self.v_scale = k, v
            self.scale_cache = None
        else:
            self.k_scale = self.v_scale = self.scale_cache = None

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[3]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[4] * (2 if self.dt.packed else 1)

    @property
    def channel(self) -> bool:
        """qkv's per-channel static scales (``[Hkv, D]``)."""
        return self.k_scale is not None and self.k_scale.dim() == 2


@dataclass(eq=False)
class StepMetadata:
    """One step's flattened batch, on the device and, for the launchers' host-side decisions, on the host.

    Sequence ``s`` owns query rows ``query_start[s]:query_start[s + 1]`` and has ``seq_lens[s]`` context tokens
    in the cache after this step's write, its queries being the last ones. Build it with :meth:`build`.
    ``plans`` holds what a back end derives from the batch alone (the Triton tile map, the split-KV plan), made
    by its first layer and reused by the others: once per step, not once per layer.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with the null block
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens_host: tuple[int, ...]
    query_start_host: tuple[int, ...]
    write_rows: torch.Tensor | None  # int64 indices of the tokens with a slot; None when every token has one
    plans: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        slot_mapping: Sequence[int],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        seq_lens: Sequence[int],
        query_start_loc: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> StepMetadata:
        """From host lists (``query_start_loc`` defaults to one query row per sequence: a decode step).

        Every check of the batch's shape is here, once per step.
        """
        seq_lens = [int(n) for n in seq_lens]
        qsl = [0, *itertools.accumulate([1] * len(seq_lens))] if query_start_loc is None else list(query_start_loc)
        qsl = [int(x) for x in qsl]
        slots = [int(s) for s in slot_mapping]
        if len(qsl) != len(seq_lens) + 1 or qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])):
            raise ValueError(f"query_start_loc must be [0, ...] non-decreasing with {len(seq_lens) + 1} entries")
        if qsl[-1] != len(slots):
            raise ValueError(f"slot_mapping has {len(slots)} entries for {qsl[-1]} query tokens")
        if any(n < b - a for n, a, b in zip(seq_lens, qsl, qsl[1:])):
            raise ValueError("every sequence's seq_len must cover its query tokens")
        tables = torch.as_tensor(block_tables, dtype=torch.int32)
        if tables.dim() != 2 or tables.shape[0] < len(seq_lens):
            raise ValueError(f"block_tables must be [{len(seq_lens)}, max_blocks], got {tuple(tables.shape)}")
        valid = [i for i, s in enumerate(slots) if s >= 0]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=tables.to(device).contiguous(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens_host=tuple(seq_lens),
            query_start_host=tuple(qsl),
            write_rows=None if len(valid) == len(slots) else torch.tensor(valid, dtype=torch.int64, device=device),
        )

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def q_lens_host(self) -> tuple[int, ...]:
        q = self.query_start_host
        return tuple(b - a for a, b in zip(q, q[1:]))

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_host, default=0)

    def plan(self, key: Any, make) -> Any:
        """``plans[key]``, made by ``make()`` the first time a layer asks for it this step."""
        if key not in self.plans:
            self.plans[key] = make()
        return self.plans[key]


class AttentionBackend(Protocol):
    """The two operations every back end implements, with the same semantics (:mod:`.reference` is the spec).

    ``write`` quantizes this step's K/V (``[T, Hkv, D]``) and scatters them into the layer's cache at the
    metadata's slots. ``attend`` runs varlen paged attention for ``query`` (``[T, Hq, D]``) over every context
    token (the new ones included: write, then attend) and returns ``[T, Hq, D]`` in the query's dtype.
    ``prepare`` checks what this back end cannot run (a head size, a block size) when the cache is built.
    """

    name: str

    def prepare(self, layer: PagedLayer) -> None: ...

    def write(self, layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None: ...

    def attend(self, layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float) -> torch.Tensor: ...


def check_kv(layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None:
    """Shape checks of a write; cheap (no data is read), and done by every back end the same way."""
    if key.dim() == 3 and key.shape[0] != meta.num_tokens:
        raise ValueError(f"slot_mapping has {meta.num_tokens} entries but key has {key.shape[0]} tokens")
    shape = (meta.num_tokens, layer.num_kv_heads, layer.head_dim)
    if tuple(key.shape) != shape or tuple(value.shape) != shape:
        raise ValueError(
            f"key and value must both be [T, Hkv, D] = {list(shape)}, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != value.dtype:
        raise ValueError(f"key is {key.dtype} but value is {value.dtype}")


def check_query(layer: PagedLayer, query: torch.Tensor, meta: StepMetadata) -> None:
    """Shape checks of an attention call, the same for every back end."""
    d, hkv = layer.head_dim, layer.num_kv_heads
    if query.dim() != 3 or query.shape[2] != d or query.shape[1] % hkv:
        raise ValueError(f"query must be [T, Hq, {d}] with Hq a multiple of {hkv}, got {tuple(query.shape)}")
    if query.shape[0] != meta.num_tokens:
        raise ValueError(f"query has {query.shape[0]} rows for the step's {meta.num_tokens} query tokens")
