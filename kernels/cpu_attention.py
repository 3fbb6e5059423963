"""Launcher for the fused CPU kernels: the engine's default attention backend on a CPU.

:class:`CpuKernels` implements the back-end interface of :mod:`.paged` with the torch reference's semantics
(:mod:`qkv.kernels.reference` is the specification and the tests compare against it):

* ``write`` quantizes K/V and scatters them into the paged cache, byte for byte what the reference writes;
* ``attend`` attends over the 8-bit blocks in place. It dequantizes one
  block at a time into an fp32 tile inside the kernel, so no step ever copies a
  sequence's context, and it runs all sequences of a step in one call (OpenMP over
  sequence x query tile x kv head) instead of one SDPA call per sequence.

A layer's C description (pointers, strides, scale mode) is made once, by ``prepare`` when the cache is built,
and kept beside the layer for as long as the layer lives.

Every output row is computed by the same operations whatever else is batched with
it (see ``csrc/paged_cpu.cpp``): results do not depend on batch composition,
chunked prefill or prefix-cache hits. Accumulation is fp32 throughout, so outputs
agree with the reference (which rounds dequantized K/V to the query dtype before
SDPA) within its tolerance, not bit for bit.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import weakref
from pathlib import Path

import torch

from .cpu_build import build_library
from .paged import PagedLayer, StepMetadata, check_kv, check_query
from .quant import check_rotation, rotation_norm
from .reference import attend_dense, visible_start

__all__ = ["CpuKernels", "DENSE_PREFILL_ROWS", "Q_TILE"]

Q_TILE = 16  # query tokens per work item: K/V tiles are dequantized once per item and reused by its rows
# A prefill chunk of at least this many query tokens goes to torch's SDPA over its gathered K/V instead
# (``dense_prefill``): a tiled GEMM (AMX or AVX-512 where the CPU has them) against this kernel's row loop.
DENSE_PREFILL_ROWS = 32

_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.int8: 5,
    torch.uint8: 6,  # a packed 4-bit cache (int4 planes, and int8 half-row planes for k8v4's K)
}
_I8, _I4 = 5, 6
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
        ("packed", _i32),
        ("planes", _i32),
        ("row_elems", _i32),
        ("side_dtype", _i32 * 2),
        ("side_plane", _i32 * 2),
        ("side_hi", _i64 * 2),
        ("side_qmax", _f32 * 2),
        ("clip", _f32 * 2),
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


class _GatherArgs(ctypes.Structure):
    _fields_ = [
        ("cache", _CacheDesc),
        ("block_table", _ptr),
        ("start", _i64),
        ("end", _i64),
        ("out", _ptr),
        ("out_dtype", _i32),
        ("num_threads", _i32),
    ]


class _RotateArgs(ctypes.Structure):
    _fields_ = [
        ("inp", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("dim", _i32),
        ("in_dtype", _i32),
        ("out_dtype", _i32),
        ("num_threads", _i32),
        ("norm", _f32),
    ]


class _ArgmaxArgs(ctypes.Structure):
    _fields_ = [
        ("logits", _ptr),
        ("rows", _ptr),
        ("out", _ptr),
        ("num_rows", _i64),
        ("vocab", _i64),
        ("row_stride", _i64),
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
        ("decode", _i32),
    ]


class _DenseArgs(ctypes.Structure):
    _fields_ = [
        ("query", _ptr),
        ("out", _ptr),
        ("kv", _ptr),
        ("stride_qt", _i64),
        ("stride_qh", _i64),
        ("stride_ot", _i64),
        ("stride_oh", _i64),
        ("T", _i64),
        ("L", _i64),
        ("num_q_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_dim", _i32),
        ("window", _i32),
        ("num_threads", _i32),
        ("sm_scale", _f32),
    ]


# The products of the dense prefill (csrc/dense_prefill.h), in order of preference: kind -> (entry point, the
# library's probe for it, the head_dim it needs a multiple of).
_DENSE_TILES = {
    "amx": ("qkv_dense_attention_amx", "qkv_amx_available", 64),  # AMX tiles (and the OS's permission)
    "avx512_bf16": ("qkv_dense_attention_dp", "qkv_bf16dp_available", 16),  # VDPBF16PS on 16 lanes
}
# The same products for the decode rows (csrc/paged_decode.h): AttnArgs.decode's codes (DecodeProducts).
_DECODE_CODES = {None: 0, "amx": 1, "avx512_bf16": 2}


def _available(lib: ctypes.CDLL, probe: str) -> bool:
    """Whether the library was built with (and the CPU runs) what ``probe`` reports on; False for older builds."""
    fn = getattr(lib, probe, None)
    if fn is None:
        return False
    fn.restype = ctypes.c_int
    return bool(fn())


def _code(t: torch.Tensor, what: str, allowed: tuple[int, ...] = (0, 1, 2)) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    if code is None or code not in allowed:
        raise ValueError(f"{what} has unsupported dtype {t.dtype}")
    return code


def _cache_desc(layer: PagedLayer) -> _CacheDesc:
    """The C view of one layer; its pointers stay valid while the layer holds its tensors."""
    kv = layer.kv
    if kv.device.type != "cpu":
        raise ValueError("the cpu attention backend needs the cache on the CPU")
    if layer.head_dim % 8 or layer.head_dim > 512 or layer.block_size > 64:
        raise ValueError(
            f"the CPU kernels need head_dim % 8 == 0, head_dim <= 512 and block_size <= 64, "
            f"got head_dim={layer.head_dim}, block_size={layer.block_size}"
        )
    dt = layer.dt
    if dt.packed and layer.head_dim % 16:
        raise ValueError(f"the CPU kernels need head_dim % 16 == 0 for {dt.name}, got {layer.head_dim}")
    desc = _CacheDesc(
        data=kv.data_ptr(),
        dtype=_code(kv, "kv_cache", tuple(range(7))),
        block_size=layer.block_size,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        rotate=int(layer.rotate),
        rot_norm=float(layer.head_dim) ** -0.5,
        qmax=layer.dt.qmax,
    )
    desc.stride_block, desc.stride_kv, desc.stride_slot, desc.stride_head = kv.stride()[:4]
    desc.packed, desc.planes, desc.row_elems = int(dt.packed), dt.planes, kv.shape[4]
    for side in (0, 1):
        desc.side_plane[side] = dt.side_planes(side)[0]
        desc.side_qmax[side] = dt.side_qmax(side)
        desc.clip[side] = (layer.k_clip, layer.v_clip)[side]
        bits = dt.side_bits(side)
        desc.side_dtype[side] = desc.dtype if not dt.packed else (_I4 if bits == 4 else _I8)
        # where channels [D/2, D) of a row start: further along the row, the same bytes' high nibbles, or the
        # next plane
        desc.side_hi[side] = layer.head_dim // 2 if not dt.packed else (0 if bits == 4 else kv.stride(1))
    if layer.scale_cache is not None:
        desc.scale_mode, desc.scale_cache = _DYNAMIC, layer.scale_cache.data_ptr()
        desc.s_stride_block, desc.s_stride_kv, desc.s_stride_slot = layer.scale_cache.stride()[:3]
    elif layer.k_scale is not None and layer.v_scale is not None:
        desc.scale_mode = _CHANNEL if layer.channel else _HEAD
        desc.k_scale, desc.v_scale = layer.k_scale.data_ptr(), layer.v_scale.data_ptr()
    return desc


class CpuKernels:
    """The compiled CPU kernels behind the back-end interface (``--attention-backend cpu``).

    ``dense_prefill``: prefill chunks of :data:`DENSE_PREFILL_ROWS` or more query tokens are gathered
    (dequantized by ``qkv_gather_kv``) and handed to torch's SDPA, whose tiled kernels are many times faster
    than the row loop at prefill; decode rows stay on the fused kernel. SDPA's blocking follows the chunk's
    shape, so with ``dense_prefill=False`` every row runs the fused kernel and a row's bits do not depend on
    the batch or the chunking (``--batch-invariant``).

    With ``dense_prefill`` the decode rows and the long chunks of a bf16 query also take bf16 products where the
    CPU (and the OS) offer them (:attr:`dense_tiles`): AMX tiles, else VDPBF16PS with AVX512-BF16
    (``csrc/paged_decode.h``, ``csrc/dense_prefill.h``): the same attention with P rounded to bf16, within bf16
    rounding of the row loop's and of SDPA's, and faster than both.
    """

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL, dense_prefill: bool = False, dense_tiles: str = "auto") -> None:
        self._write = lib.qkv_write_kv_cache
        self._attend = lib.qkv_paged_attention
        self._gather = lib.qkv_gather_kv
        self._rotate = lib.qkv_hadamard_rows
        self._argmax = lib.qkv_argmax_rows
        # a library built from an older source lacks the newer entry points (scripts/bench_cpu_attention.py loads those)
        self._dense_entry = {kind: getattr(lib, spec[0], None) for kind, spec in _DENSE_TILES.items()}
        for fn, args in (
            (self._write, _WriteArgs),
            (self._attend, _AttnArgs),
            (self._gather, _GatherArgs),
            (self._rotate, _RotateArgs),
            (self._argmax, _ArgmaxArgs),
            *((fn, _DenseArgs) for fn in self._dense_entry.values() if fn is not None),
        ):
            fn.argtypes, fn.restype = [ctypes.POINTER(args)], ctypes.c_int
        self.dense_prefill = dense_prefill
        # QKV_CPU_AMX=0 keeps every row on the row loop and SDPA (to compare the paths on one machine)
        wanted = dense_prefill and os.environ.get("QKV_CPU_AMX", "1") != "0"
        have = {kind: wanted and _available(lib, spec[1]) for kind, spec in _DENSE_TILES.items()}
        if dense_tiles not in ("auto", *have):
            raise ValueError(f"dense_tiles must be 'auto', 'amx' or 'avx512_bf16', not {dense_tiles!r}")
        order = tuple(_DENSE_TILES) if dense_tiles == "auto" else (dense_tiles,)  # AMX first: 16x the products
        #: which products compute long bf16 prefill chunks and bf16 decode rows: AMX tiles, VDPBF16PS
        #: (AVX512-BF16), or None (SDPA and the row loop)
        self.dense_tiles: str | None = next((kind for kind in order if have[kind]), None)
        # One C description per layer, dropped with the layer.
        self._descs: weakref.WeakKeyDictionary[PagedLayer, _CacheDesc] = weakref.WeakKeyDictionary()

    @classmethod
    def build(cls, build_dir: Path, dense_prefill: bool = False, dense_tiles: str = "auto") -> CpuKernels:
        """Compile on first use (cached in ``build_dir``); raises ``KernelBuildError`` without a compiler."""
        return cls(build_library(Path(build_dir)), dense_prefill, dense_tiles)

    def prepare(self, layer: PagedLayer) -> None:
        """Check what these kernels cannot run and make the layer's C description (once per layer)."""
        if layer not in self._descs:
            self._descs[layer] = _cache_desc(layer)

    def _desc(self, layer: PagedLayer) -> _CacheDesc:
        self.prepare(layer)
        return self._descs[layer]

    def write(self, layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None:
        """Quantize ``key``/``value`` ([T, Hkv, D]) and scatter them into the layer's cache at the step's slots."""
        cache = self._desc(layer)
        check_kv(layer, key, value, meta)
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        args = _WriteArgs(
            cache=cache,
            key=key.data_ptr(),
            value=value.data_ptr(),
            slot_mapping=meta.slot_mapping.data_ptr(),
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

    def attend(self, layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float) -> torch.Tensor:
        """Varlen paged attention over ``query`` ([T, Hq, D]); returns ``[T, Hq, D]`` in query's dtype."""
        cache = self._desc(layer)
        check_query(layer, query, meta)
        query = query if query.stride(-1) == 1 else query.contiguous()
        split = meta.plan(("cpu_dense", DENSE_PREFILL_ROWS), lambda: _split_dense(meta)) if self.dense_prefill else None
        if split is None:
            return self._fused(cache, query, meta, sm_scale, layer.sliding_window)
        dense, rest, rest_rows = split
        out = torch.empty_like(query)
        for s in dense:
            q0, q1 = meta.query_start_host[s], meta.query_start_host[s + 1]
            out[q0:q1] = self._dense(layer, query[q0:q1], meta, s, sm_scale)
        if rest is not None:
            out[rest_rows] = self._fused(cache, query[rest_rows], rest, sm_scale, layer.sliding_window)
        return out

    def _fused(
        self, cache: _CacheDesc, query: torch.Tensor, meta: StepMetadata, sm_scale: float, window: int | None
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        args = _AttnArgs(
            cache=cache,
            query=query.data_ptr(),
            out=out.data_ptr(),
            block_tables=meta.block_tables.data_ptr(),
            seq_lens=meta.seq_lens.data_ptr(),
            query_start_loc=meta.query_start_loc.data_ptr(),
            stride_qt=query.stride(0),
            stride_qh=query.stride(1),
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            stride_bt=meta.block_tables.stride(0),
            q_dtype=_code(query, "query"),
            num_q_heads=query.shape[1],
            num_seqs=meta.num_seqs,
            window=int(window or 0),
            q_tile=Q_TILE,
            num_threads=torch.get_num_threads(),
            sm_scale=float(sm_scale),
            decode=_DECODE_CODES[self.dense_tiles],
        )
        if query.shape[0] and meta.num_seqs and self._attend(ctypes.byref(args)) != 0:
            raise RuntimeError("qkv_paged_attention failed")
        return out

    def gather(
        self, layer: PagedLayer, block_table: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Positions ``[start, end)`` of one sequence (its int32 ``block_table``) as contiguous ``[2, Hkv, L, D]``
        K and V in ``dtype``, dequantized exactly as the reference does (``reference.gather_kv``)."""
        kv = torch.empty(2, layer.num_kv_heads, end - start, layer.head_dim, dtype=dtype)
        table = block_table.to(torch.int32).contiguous()
        args = _GatherArgs(
            cache=self._desc(layer),
            block_table=table.data_ptr(),
            start=start,
            end=end,
            out=kv.data_ptr(),
            out_dtype=_code(kv, "the gathered K/V"),
            num_threads=torch.get_num_threads(),
        )
        if self._gather(ctypes.byref(args)) != 0:
            raise RuntimeError("qkv_gather_kv failed")
        return kv

    def _dense(
        self, layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, s: int, sm_scale: float
    ) -> torch.Tensor:
        """One long prefill chunk: its visible K/V gathered and dequantized, then the reference's SDPA call (or, with
        :attr:`dense_tiles` and bf16 queries, the same attention in bf16 products: :meth:`tiles_prefill`)."""
        seq_len, window = meta.seq_lens_host[s], layer.sliding_window
        start = visible_start(seq_len, query.shape[0], window)
        kv = self.gather(layer, meta.block_tables[s], start, seq_len, query.dtype)
        tiled = self.tiles_prefill(layer.head_dim, query.dtype)

        def attend(q: torch.Tensor) -> torch.Tensor:
            if tiled:
                return self._tiled(q, kv, seq_len - start, window, sm_scale)
            return attend_dense(q, kv[0], kv[1], start, seq_len, window, sm_scale)

        if layer.rotate:  # the cache holds K H and V H: (qH).(kH) = q.k, and the output is rotated back
            return self.hadamard(attend(self.hadamard(query)))
        return attend(query)

    def tiles_prefill(self, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether a long prefill chunk of these queries runs on :attr:`dense_tiles` (else SDPA, bit for bit)."""
        tiles = self.dense_tiles
        return tiles is not None and dtype == torch.bfloat16 and head_dim % _DENSE_TILES[tiles][2] == 0

    def _tiled(
        self, query: torch.Tensor, kv: torch.Tensor, length: int, window: int | None, sm_scale: float
    ) -> torch.Tensor:
        """:func:`attend_dense` in bf16 products (:attr:`dense_tiles`: AMX tiles or VDPBF16PS): bf16 ``[q_len, Hq,
        D]`` queries, the last of the ``length`` positions of the contiguous ``[2, Hkv, length, D]`` keys and
        values; P is rounded to bf16, so the rows are SDPA's to bf16 rounding, not bit for bit."""
        entry = self._dense_entry[self.dense_tiles] if self.dense_tiles else None
        assert entry is not None
        query = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty_like(query)
        args = _DenseArgs(
            query=query.data_ptr(),
            out=out.data_ptr(),
            kv=kv.data_ptr(),
            stride_qt=query.stride(0),
            stride_qh=query.stride(1),
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            T=query.shape[0],
            L=length,
            num_q_heads=query.shape[1],
            num_kv_heads=kv.shape[1],
            head_dim=query.shape[2],
            window=int(window or 0),
            num_threads=torch.get_num_threads(),
            sm_scale=float(sm_scale),
        )
        if entry(ctypes.byref(args)) != 0:
            raise RuntimeError(f"the dense prefill on {self.dense_tiles} failed")
        return out

    def hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """``hadamard_rotate(x).to(x.dtype)`` bit for bit (the same butterflies in the same order), in one pass
        of C++: torch's butterflies are log2(D) passes of stack and slice, which cost a rotated cache's dense
        prefill more than its attention."""
        x = x.contiguous()
        d = x.shape[-1]
        check_rotation("hadamard", d)
        out = torch.empty_like(x)
        code = _code(x, "the rotated rows")
        args = _RotateArgs(
            inp=x.data_ptr(),
            out=out.data_ptr(),
            rows=x.numel() // d,
            dim=d,
            in_dtype=code,
            out_dtype=code,
            num_threads=torch.get_num_threads(),
            norm=float(rotation_norm(d)),
        )
        if x.numel() and self._rotate(ctypes.byref(args)) != 0:
            raise RuntimeError("qkv_hadamard_rows failed")
        return out

    def argmax_rows(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """``logits[rows].float().argmax(-1).tolist()`` (the first maximum, or the first NaN) in one pass of C++
        over each row: torch's argmax reduces a bf16 row element by element, and widening first copies the rows.
        ``logits``: a CPU ``[N, vocab]`` tensor of fp32, bf16 or fp16."""
        if logits.dim() != 2 or logits.device.type != "cpu":
            raise ValueError(f"logits must be a CPU [N, vocab] tensor, got {tuple(logits.shape)} on {logits.device}")
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        if not rows:
            return []
        if min(rows) < 0 or max(rows) >= logits.shape[0]:
            raise ValueError(f"rows must lie in [0, {logits.shape[0]}), got {rows}")
        if logits.shape[1] == 0:
            raise ValueError(f"argmax over an empty vocabulary: logits {tuple(logits.shape)}")
        idx = torch.tensor(rows, dtype=torch.int64)
        out = torch.empty(len(rows), dtype=torch.int64)
        args = _ArgmaxArgs(
            logits=logits.data_ptr(),
            rows=idx.data_ptr(),
            out=out.data_ptr(),
            num_rows=len(rows),
            vocab=logits.shape[1],
            row_stride=logits.stride(0),
            in_dtype=_code(logits, "logits"),
            num_threads=torch.get_num_threads(),
        )
        if self._argmax(ctypes.byref(args)) != 0:
            raise RuntimeError("qkv_argmax_rows failed")
        return out.tolist()


def _split_dense(meta: StepMetadata) -> tuple[list[int], StepMetadata | None, torch.Tensor] | None:
    """The step's sequences with a dense prefill chunk, and the metadata and query rows of the others (once
    per step, from host lists); ``None`` when no chunk is long enough."""
    q_lens = meta.q_lens_host
    dense = [s for s, n in enumerate(q_lens) if n >= DENSE_PREFILL_ROWS]
    if not dense:
        return None
    others = [s for s, n in enumerate(q_lens) if 0 < n < DENSE_PREFILL_ROWS]
    if not others:
        return dense, None, torch.empty(0, dtype=torch.long)
    qsl = meta.query_start_host
    rows = [r for s in others for r in range(qsl[s], qsl[s + 1])]
    sub = StepMetadata.build(
        [0] * len(rows),  # the fused kernel reads no slots; the write used the whole step's
        meta.block_tables[others],
        [meta.seq_lens_host[s] for s in others],
        [0, *itertools.accumulate(q_lens[s] for s in others)],
        device=meta.seq_lens.device,
    )
    return dense, sub, torch.tensor(rows, dtype=torch.long)
