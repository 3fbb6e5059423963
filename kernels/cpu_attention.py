"""Launcher for the fused CPU kernels: the engine's default attention backend on a CPU.

:class:`CpuKernels` has the torch reference's two entry points with the same
signatures and semantics (:mod:`qkv.kernels.reference` is the specification and
the tests compare against it):

* ``write_kv_cache`` quantizes K/V and scatters them into the paged cache,
  byte for byte what the reference writes;
* ``paged_attention`` attends over the 8-bit blocks in place. It dequantizes one
  block at a time into an fp32 tile inside the kernel, so no step ever copies a
  sequence's context, and it runs all sequences of a step in one call (OpenMP over
  sequence x query tile x kv head) instead of one SDPA call per sequence.

Every output row is computed by the same operations whatever else is batched with
it (see ``csrc/paged_cpu.cpp``): results do not depend on batch composition,
chunked prefill or prefix-cache hits. Accumulation is fp32 throughout, so outputs
agree with the reference (which rounds dequantized K/V to the query dtype before
SDPA) within its tolerance, not bit for bit.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from pathlib import Path

import torch

from .cpu_build import build_library
from .quant import CacheDtype, check_rotation

__all__ = ["CpuKernels", "Q_TILE"]

Q_TILE = 16  # query tokens per work item: K/V tiles are dequantized once per item and reused by its rows

_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.int8: 5,
}
_NONE, _HEAD, _CHANNEL, _DYNAMIC = range(4)

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _CacheDesc(ctypes.Structure):
    _fields_ = [
        ("data", _ptr),
        ("stride_block", _i64),
        ("stride_kv", _i64),
        ("stride_slot", _i64),
        ("stride_head", _i64),
        ("scale_cache", _ptr),
        ("s_stride_block", _i64),
        ("s_stride_kv", _i64),
        ("s_stride_slot", _i64),
        ("k_scale", _ptr),
        ("v_scale", _ptr),
        ("dtype", _i32),
        ("scale_mode", _i32),
        ("block_size", _i32),
        ("num_kv_heads", _i32),
        ("head_dim", _i32),
        ("rotate", _i32),
        ("rot_norm", _f32),
        ("qmax", _f32),
    ]


class _WriteArgs(ctypes.Structure):
    _fields_ = [
        ("cache", _CacheDesc),
        ("key", _ptr),
        ("value", _ptr),
        ("slot_mapping", _ptr),
        ("num_tokens", _i64),
        ("stride_kt", _i64),
        ("stride_kh", _i64),
        ("stride_vt", _i64),
        ("stride_vh", _i64),
        ("in_dtype", _i32),
        ("num_threads", _i32),
    ]


class _AttnArgs(ctypes.Structure):
    _fields_ = [
        ("cache", _CacheDesc),
        ("query", _ptr),
        ("out", _ptr),
        ("block_tables", _ptr),
        ("seq_lens", _ptr),
        ("query_start_loc", _ptr),
        ("stride_qt", _i64),
        ("stride_qh", _i64),
        ("stride_ot", _i64),
        ("stride_oh", _i64),
        ("stride_bt", _i64),
        ("q_dtype", _i32),
        ("num_q_heads", _i32),
        ("num_seqs", _i32),
        ("window", _i32),
        ("q_tile", _i32),
        ("num_threads", _i32),
        ("sm_scale", _f32),
    ]


def _code(t: torch.Tensor, what: str, allowed: tuple[int, ...] = (0, 1, 2)) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    if code is None or code not in allowed:
        raise ValueError(f"{what} has unsupported dtype {t.dtype}")
    return code


def _cache_desc(
    kv_cache: torch.Tensor,
    dt: CacheDtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale_cache: torch.Tensor | None,
    rotate: bool,
    keep: list[torch.Tensor],
) -> _CacheDesc:
    """Check one layer's cache, scales and rotation; tensors made here are appended to ``keep``."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    num_blocks, _, block_size, num_heads, head_dim = kv_cache.shape
    if kv_cache.dtype != dt.storage:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match {dt.name} storage {dt.storage}")
    if kv_cache.device.type != "cpu" or kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be a CPU tensor, contiguous in its last (head_dim) dimension")
    if head_dim % 8 or block_size > 64:
        raise ValueError(
            f"the CPU kernels need head_dim % 8 == 0 and block_size <= 64, "
            f"got head_dim={head_dim}, block_size={block_size}"
        )
    if rotate:
        check_rotation("hadamard", head_dim)
    desc = _CacheDesc(
        data=kv_cache.data_ptr(),
        dtype=_code(kv_cache, "kv_cache", tuple(range(6))),
        block_size=block_size,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        rotate=int(rotate),
        rot_norm=float(head_dim) ** -0.5,
        qmax=dt.qmax,
    )
    desc.stride_block, desc.stride_kv, desc.stride_slot, desc.stride_head = kv_cache.stride()[:4]
    if dt.dynamic:
        expected = (num_blocks, 2, block_size, num_heads)
        if (
            scale_cache is None
            or tuple(scale_cache.shape) != expected
            or scale_cache.dtype != torch.float32
            or scale_cache.stride(-1) != 1
        ):
            raise ValueError(f"{dt.name} needs a float32 scale_cache of shape {expected}, contiguous in its last dim")
        desc.scale_mode, desc.scale_cache = _DYNAMIC, scale_cache.data_ptr()
        desc.s_stride_block, desc.s_stride_kv, desc.s_stride_slot = scale_cache.stride()[:3]
    elif dt.quantized:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{dt.name} needs k_scale and v_scale")
        channel = k_scale.dim() == 2 or v_scale.dim() == 2
        scales = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            s = s.to(torch.float32)
            if channel:
                if tuple(s.shape) != (num_heads, head_dim):
                    raise ValueError(
                        f"per-channel {name} must be [num_kv_heads={num_heads}, head_dim={head_dim}], "
                        f"got {tuple(s.shape)}"
                    )
            elif s.numel() in (1, num_heads):
                s = s.reshape(-1).expand(num_heads)
            else:
                raise ValueError(
                    f"{name} must have shape [num_kv_heads={num_heads}] (or one element), got {tuple(s.shape)}"
                )
            if s.data_ptr() != (k_scale if name == "k_scale" else v_scale).data_ptr() or not s.is_contiguous():
                s = s.contiguous()
                keep.append(s)  # a converted copy: the caller must hold it through the call
            scales.append(s)
        desc.scale_mode = _CHANNEL if channel else _HEAD
        desc.k_scale, desc.v_scale = scales[0].data_ptr(), scales[1].data_ptr()
    return desc


class CpuKernels:
    """The compiled CPU kernels behind the reference's ``write_kv_cache`` / ``paged_attention`` signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._write = lib.qkv_write_kv_cache
        self._attend = lib.qkv_paged_attention
        for fn, args in ((self._write, _WriteArgs), (self._attend, _AttnArgs)):
            fn.argtypes, fn.restype = [ctypes.POINTER(args)], ctypes.c_int
        # Checked layer descriptions, reused while a layer's tensors stay the same (30 layers x 2 calls a
        # step would otherwise redo the checks every step). Only descriptions that point at the caller's
        # own tensors are kept, so a hit never reads a stale copy.
        self._descs: OrderedDict[tuple, _CacheDesc] = OrderedDict()

    def _desc(
        self,
        kv_cache: torch.Tensor,
        dt: CacheDtype,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        scale_cache: torch.Tensor | None,
        rotate: bool,
        keep: list[torch.Tensor],
    ) -> _CacheDesc:
        key = (
            dt.name,
            rotate,
            *(
                None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())
                for t in (kv_cache, k_scale, v_scale, scale_cache)
            ),
        )
        desc = self._descs.get(key)
        if desc is None:
            desc = _cache_desc(kv_cache, dt, k_scale, v_scale, scale_cache, rotate, keep)
            if not keep:
                self._descs[key] = desc
                if len(self._descs) > 256:
                    self._descs.popitem(last=False)
        return desc

    @classmethod
    def build(cls, build_dir: Path) -> CpuKernels:
        """Compile on first use (cached in ``build_dir``); raises ``KernelBuildError`` without a compiler."""
        return cls(build_library(Path(build_dir)))

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        dt: CacheDtype,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        scale_cache: torch.Tensor | None = None,
        rotate: bool = False,
    ) -> None:
        """Quantize ``key``/``value`` ([T, Hkv, D]) and scatter them into ``kv_cache`` at ``slot_mapping``."""
        keep: list[torch.Tensor] = []
        cache = self._desc(kv_cache, dt, k_scale, v_scale, scale_cache, rotate, keep)
        if key.dim() != 3 or key.shape != value.shape or tuple(key.shape[1:]) != tuple(kv_cache.shape[3:]):
            raise ValueError(
                f"key and value must both be [T, {kv_cache.shape[3]}, {kv_cache.shape[4]}], "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if slot_mapping.dim() != 1 or slot_mapping.numel() != key.shape[0]:
            raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
        if key.dtype != value.dtype:
            raise ValueError(f"key is {key.dtype} but value is {value.dtype}")
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        args = _WriteArgs(
            cache=cache,
            key=key.data_ptr(),
            value=value.data_ptr(),
            slot_mapping=slots.data_ptr(),
            num_tokens=key.shape[0],
            stride_kt=key.stride(0),
            stride_kh=key.stride(1),
            stride_vt=value.stride(0),
            stride_vh=value.stride(1),
            in_dtype=_code(key, "key"),
            num_threads=torch.get_num_threads(),
        )
        if key.shape[0] and self._write(ctypes.byref(args)) != 0:
            raise RuntimeError("qkv_write_kv_cache failed")

    def paged_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        dt: CacheDtype,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        scale_cache: torch.Tensor | None,
        sm_scale: float,
        sliding_window: int | None = None,
        rotate: bool = False,
    ) -> torch.Tensor:
        """Varlen paged attention over ``query`` ([T, Hq, D]); returns ``[T, Hq, D]`` in query's dtype."""
        keep: list[torch.Tensor] = []
        cache = self._desc(kv_cache, dt, k_scale, v_scale, scale_cache, rotate, keep)
        num_kv_heads, head_dim = kv_cache.shape[3:]
        if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
            raise ValueError(
                f"query must be [T, Hq, {head_dim}] with Hq a multiple of {num_kv_heads}, got {tuple(query.shape)}"
            )
        num_seqs = seq_lens.numel()
        if query_start_loc.numel() != num_seqs + 1 or block_tables.dim() != 2 or block_tables.shape[0] < num_seqs:
            raise ValueError(
                f"need query_start_loc [{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks], "
                f"got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        query = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty_like(query)
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        qsl = query_start_loc.to(torch.int32).contiguous()
        args = _AttnArgs(
            cache=cache,
            query=query.data_ptr(),
            out=out.data_ptr(),
            block_tables=tables.data_ptr(),
            seq_lens=lens.data_ptr(),
            query_start_loc=qsl.data_ptr(),
            stride_qt=query.stride(0),
            stride_qh=query.stride(1),
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            stride_bt=tables.stride(0),
            q_dtype=_code(query, "query"),
            num_q_heads=query.shape[1],
            num_seqs=num_seqs,
            window=int(sliding_window or 0),
            q_tile=Q_TILE,
            num_threads=torch.get_num_threads(),
            sm_scale=float(sm_scale),
        )
        if query.shape[0] and num_seqs and self._attend(ctypes.byref(args)) != 0:
            raise RuntimeError("qkv_paged_attention failed")
        return out
