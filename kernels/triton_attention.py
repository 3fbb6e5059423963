"""Triton varlen paged attention over a (possibly quantized) paged KV cache.

Same semantics as :func:`qkv.kernels.reference.attend` (the layer and step descriptions are :mod:`.paged`'s):
sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``, its
queries are the last ``q_len`` of its ``seq_lens[s]`` context tokens, and query
``i`` sits at position ``seq_lens[s] - q_len + i``. One kernel covers prefill
(with or without a cached prefix), decode and mixed batches.

Launch grid: ``(num_tiles, num_kv_heads, num_segments)``. A tile is up to ``BLOCK_Q`` consecutive
query tokens of one sequence; the host builds a per-program map ``tile -> (seq,
tile index in seq)``, once per step from the step's host-side lengths (:meth:`.paged.StepMetadata.plan`), so
no program is wasted on padding in a mixed batch and no layer waits on the device. A
program handles *all* ``GROUP = Hq / Hkv`` query heads of its kv head (GQA without
expanding K/V): its ``BLOCK_M`` rows are (token, head-in-group) pairs, so each K/V
tile is loaded and dequantized once and reused by the whole group.

The K/V loop walks key positions ``[lo, hi)`` in tiles of ``BLOCK_N``, translating
positions to cache slots through the block table. ``hi`` never exceeds the tile's
last query position + 1 (<= seq_len) and ``lo`` is the sliding-window start, and
loads outside ``[lo, hi)`` are masked, so stale bytes (possibly NaN in fp8) past a
sequence's length or before its window are never read. Softmax is an fp32 online
softmax; dequantization (static per-head scale or per-slot dynamic scale) happens
in registers. qkv's per-channel static scales (``CHANNEL``) are folded instead:
the K scale into the query tile once per program (``q . (k_q * s_k) = (q * s_k) . k_q``)
and the V scale into the output (``sum p (v_q * s_v) = s_v * sum p v_q``). With
``ROTATE`` the query tile is Hadamard-rotated after loading and the output
rotated back before the store (:mod:`.triton_hadamard`). Tiles come from
:mod:`.triton_tiles`; fp32 queries at head_dim 256 (``Q_CHUNK < HEAD_DIM``) are rotated
and K-scaled by the launcher and read chunk by chunk, so they never sit in registers whole.
``BLOCK_SIZE`` (the paged block size) is a constexpr, so slot arithmetic is shifts.

Packed 4-bit caches (``PACKED``, layout in :mod:`.paged`) are read as full ``[BLOCK_N, HEAD_DIM]`` tiles
whose byte addresses repeat: channel ``j`` and ``j + D/2`` of an int4 row come from the same byte, low and
high nibble, sign-extended by int8 shifts; k8v4's int8 K reads its upper half-row from the next plane. So
the dots and the softmax are the 8-bit code path's.

fp8 caches are decoded by the GPU's conversion where it has one (sm_89+,
``FP8_NATIVE``); on sm_80 the launcher passes the cache as ``uint8`` and the bytes are
decoded with integer arithmetic (:mod:`.triton_fp8`), to the same fp32 values.

Decode-only batches may be split along the keys (``SPLIT``, grid axis 2 =
segments, :mod:`.triton_split_kv`): each program then stores its unnormalized
partial result and a merge kernel combines the segments, so a long decode with few
(sequence, kv head) pairs still starts enough programs to fill the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import device_num_sms, fp8_native, launch, runs_on_gpu, target_arch
from .launch import unused_pointer as _unused
from .paged import PagedLayer, StepMetadata, check_query
from .quant import hadamard_rotate
from .triton_fp8 import fp8_decode_bits, fp8_format
from .triton_hadamard import fwht_rows
from .triton_split_kv import merge_segments, num_kv_segments, partial_buffers
from .triton_tiles import attention_tiles

__all__ = ["TilePlan", "triton_attend"]


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    scale_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_idx_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sm_scale,
    window,
    num_q_heads,
    num_segments,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_skv,
    stride_ss,
    stride_bt,
    k_hi,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DYNAMIC: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHANNEL: tl.constexpr,
    ROTATE: tl.constexpr,
    LOG2_D: tl.constexpr,
    ROT_NORM: tl.constexpr,
    SPLIT: tl.constexpr,
    Q_CHUNK: tl.constexpr,
    PACKED: tl.constexpr,
    K_INT4: tl.constexpr,
    V_PLANE: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + pid)
    tile = tl.load(tile_idx_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_q_pos = seq_len - q_len  # context position of this sequence's first query

    # Rows of the tile: (query token, query head of this kv head's group).
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    q_pos = first_q_pos + tok
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q_ty = q_ptr.dtype.element_ty
    q_row_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
    if CHANNEL:
        v_scale_ch = tl.load(v_scale_ptr + kv_head * HEAD_DIM + d)
    if Q_CHUNK == HEAD_DIM:  # the query tile stays in registers for the whole loop
        q = tl.load(q_row_ptrs + d[None, :], mask=row_ok[:, None], other=0.0)
        if ROTATE:  # (qH).(kH) = q.k; rounded back to the query dtype like the reference
            q = fwht_rows(q.to(tl.float32), BLOCK_M, HEAD_DIM, LOG2_D, ROT_NORM).to(q_ty)
        if CHANNEL:  # fold the [D] K scale of this kv head into the query
            q = (q.to(tl.float32) * tl.load(k_scale_ptr + kv_head * HEAD_DIM + d)[None, :]).to(q_ty)
        if DOT_FP32:
            q = q.to(tl.float32)
    # else: q_ptr holds the query already rotated and K-scaled by the launcher, and the
    # loop reads it chunk by chunk (fp32 at head_dim 256 would not fit in registers)

    # Keys visible to any row of this tile: [lo, hi).
    tile_first_pos = first_q_pos + tile * BLOCK_Q
    hi = tl.minimum(tile_first_pos + BLOCK_Q, seq_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(tile_first_pos - window + 1, 0)

    if QUANTIZED and not DYNAMIC and not CHANNEL:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    first_n = (lo // BLOCK_N) * BLOCK_N
    if SPLIT:  # this program's segment: a run of whole key tiles of [first_n, hi)
        seg = tl.program_id(2)
        tiles_per_seg = tl.cdiv(tl.cdiv(hi - first_n, BLOCK_N), num_segments)
        first_n = first_n + seg * tiles_per_seg * BLOCK_N
        hi = tl.minimum(hi, first_n + tiles_per_seg * BLOCK_N)

    for start_n in range(first_n, hi, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_ok = (k_pos >= lo) & (k_pos < hi)
        # position -> slot through the block table (never past seq_len)
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot_off = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_ptrs = cache_ptr + slot_off[:, None] + d[None, :]
        # K and V dequantized inline (in the interpreter every call into a jit helper costs ms)
        k_scale_n = 1.0
        v_scale_n = 1.0
        if DYNAMIC:  # per-slot scales stored beside the block
            s_ptrs = scale_cache_ptr + block * stride_sb + (k_pos % BLOCK_SIZE) * stride_ss + kv_head
            k_scale_n = tl.load(s_ptrs, mask=k_ok, other=0.0)[:, None]
            v_scale_n = tl.load(s_ptrs + stride_skv, mask=k_ok, other=0.0)[:, None]
        elif QUANTIZED and not CHANNEL:  # CHANNEL: scales folded into the query and the output
            k_scale_n = k_scale
            v_scale_n = v_scale
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for c in tl.static_range(HEAD_DIM // Q_CHUNK + 1):  # K (whole or in chunks), then V
            if PACKED:  # channels [0, D/2) along the row, [D/2, D) as high nibbles (int4) or k_hi further (int8)
                if c == HEAD_DIM // Q_CHUNK:  # V: int4 in plane V_PLANE
                    dc = d
                    upper = dc >= HEAD_DIM // 2
                    off = V_PLANE * stride_ckv + dc % (HEAD_DIM // 2)
                    raw = tl.load(cache_ptr + slot_off[:, None] + off[None, :], mask=k_ok[:, None], other=0)
                    b = raw.to(tl.int8, bitcast=True)  # nibbles sign-extended by int8 shifts
                    x = tl.where(upper[None, :], b >> 4, (b << 4) >> 4)
                    scale_n = v_scale_n
                else:
                    dc = c * Q_CHUNK + tl.arange(0, Q_CHUNK)
                    upper = dc >= HEAD_DIM // 2
                    off = dc % (HEAD_DIM // 2) + tl.where(upper, k_hi, 0)
                    raw = tl.load(cache_ptr + slot_off[:, None] + off[None, :], mask=k_ok[:, None], other=0)
                    if K_INT4:
                        b = raw.to(tl.int8, bitcast=True)
                        x = tl.where(upper[None, :], b >> 4, (b << 4) >> 4)
                    else:
                        x = raw.to(tl.int8, bitcast=True)
                    scale_n = k_scale_n
            elif c == HEAD_DIM // Q_CHUNK:
                dc = d
                x = tl.load(kv_ptrs + stride_ckv, mask=k_ok[:, None], other=0.0)
                scale_n = v_scale_n
            else:
                dc = c * Q_CHUNK + tl.arange(0, Q_CHUNK)
                x = tl.load(cache_ptr + slot_off[:, None] + dc[None, :], mask=k_ok[:, None], other=0.0)
                scale_n = k_scale_n
            if MANT_BITS > 0 and not FP8_NATIVE:  # sm_80: fp8 bytes decoded with integers
                x = fp8_decode_bits(x, MANT_BITS, MIN_EXP)
            if QUANTIZED:
                x = x.to(tl.float32) * scale_n
            x = x.to(q_ty)  # like the reference: dequantize to the query dtype, then multiply
            if DOT_FP32:
                x = x.to(tl.float32)
            if c == HEAD_DIM // Q_CHUNK:
                v = x
            elif Q_CHUNK == HEAD_DIM:
                s = tl.dot(q, tl.trans(x), input_precision=DOT_PRECISION)
            else:
                qc = tl.load(q_row_ptrs + dc[None, :], mask=row_ok[:, None], other=0.0)
                if DOT_FP32:
                    qc = qc.to(tl.float32)
                s += tl.dot(qc, tl.trans(x), input_precision=DOT_PRECISION)
        s = s * sm_scale
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # online softmax; rows with nothing visible yet keep m = -inf without NaNs
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(q_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:  # unnormalized partials; merge_segments finishes (scale, rotation, cast)
        part = (q_rows * num_q_heads + head) * num_segments + tl.program_id(2)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if CHANNEL:
            acc = acc * v_scale_ch[None, :]
        if ROTATE:
            acc = fwht_rows(acc, BLOCK_M, HEAD_DIM, LOG2_D, ROT_NORM)
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class TilePlan(NamedTuple):
    """The per-step part of a launch: which sequence and tile each program takes, and the split-KV segments."""

    tile_seq: torch.Tensor  # [num_tiles] int32
    tile_idx: torch.Tensor  # [num_tiles] int32
    segments: int


def _tile_plan(meta: StepMetadata, block_q: int, num_kv_heads: int, window: int | None, num_sms: int) -> TilePlan:
    """Built on the host from the step's lengths: one small copy to the device, no synchronization."""
    q_lens = meta.q_lens_host
    tile_seq: list[int] = []
    tile_idx: list[int] = []
    for s, n in enumerate(q_lens):
        tiles = -(-n // block_q)
        tile_seq += [s] * tiles
        tile_idx += range(tiles)
    segments = 1
    if meta.max_q_len == 1:  # decode-only: split long contexts over more programs
        context = max(n for n, q in zip(meta.seq_lens_host, q_lens) if q > 0)
        if window is not None:
            context = min(context, window)
        segments = num_kv_segments(len(tile_seq), num_kv_heads, context, num_sms)
    device = meta.seq_lens.device
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return TilePlan(as_tensor(tile_seq), as_tensor(tile_idx), segments)


def triton_attend(
    layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float, *, num_sms: int | None = None
) -> torch.Tensor:
    """Varlen paged attention over ``query`` ([T, Hq, D]); returns ``[T, Hq, D]`` in query's dtype.

    ``num_sms`` overrides the SM count the split-KV heuristic fills (default: the
    device's, 132 off CUDA).
    """
    check_query(layer, query, meta)
    kv_cache, dt = layer.kv, layer.dt
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = layer.num_kv_heads
    device = query.device
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    arch = target_arch(device)
    tiles = attention_tiles(group, meta.max_q_len, head_dim, query.element_size(), arch)
    sms = num_sms or device_num_sms(device)
    window = layer.sliding_window
    plan = meta.plan(
        ("triton", tiles.block_q, num_kv_heads, window, sms),
        lambda: _tile_plan(meta, tiles.block_q, num_kv_heads, window, sms),
    )
    num_tiles, segments = plan.tile_seq.numel(), plan.segments
    if num_tiles == 0:
        return out
    split = segments > 1
    if split:
        part_m, part_l, part_acc = partial_buffers(num_tokens, num_q_heads, segments, head_dim, device)
    else:
        part_m = part_l = part_acc = _unused(device)
    unused = _unused(device)
    scale_cache = layer.scale_cache if layer.scale_cache is not None else unused
    s_strides = layer.scale_cache.stride()[:3] if layer.scale_cache is not None else (0, 0, 0)
    k_scale = layer.k_scale if layer.k_scale is not None else unused
    v_scale = layer.v_scale if layer.v_scale is not None else unused
    channel, rotate = layer.channel, layer.rotate

    native = fp8_native(arch)
    mant_bits, min_exp = fp8_format(dt.storage)
    cache_arg = kv_cache if native or dt.kind != "float" else kv_cache.view(torch.uint8)
    # bf16/fp16 dots are native on a GPU. fp32 dots use three TF32 passes there (fp32
    # accuracy on tensor cores; the IEEE FMA dot needs so many registers that it spills)
    # and IEEE in the interpreter, which also multiplies bf16 operands as raw uint16.
    on_gpu = runs_on_gpu(device)
    dot_fp32 = query.dtype == torch.float32 or not on_gpu
    precision = ("tf32x3" if on_gpu else "ieee") if dot_fp32 else "tf32"
    q_arg = query
    if tiles.q_chunk < head_dim:  # the kernel reads the query in chunks: rotate and K-scale it here
        if rotate:
            q_arg = hadamard_rotate(q_arg).to(query.dtype)
        if channel:
            q_arg = (q_arg.float() * k_scale.repeat_interleave(group, 0)).to(query.dtype)
        q_arg = q_arg.contiguous()
    launch(
        _paged_attention_kernel,
        (num_tiles, num_kv_heads, segments),
        q_arg,
        out,
        cache_arg,
        scale_cache,
        k_scale,
        v_scale,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        plan.tile_seq,
        plan.tile_idx,
        part_m,
        part_l,
        part_acc,
        float(sm_scale),
        int(window or 0),
        num_q_heads,
        segments,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_cache.stride()[:4],
        *s_strides,
        meta.block_tables.stride(0),
        kv_cache.stride(1) if dt.packed and dt.side_bits(0) == 8 else 0,  # k8v4's K: its upper half-row plane
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=layer.block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
        QUANTIZED=dt.quantized,
        DYNAMIC=dt.dynamic,
        USE_WINDOW=window is not None,
        MANT_BITS=mant_bits,
        MIN_EXP=min_exp,
        FP8_NATIVE=native,
        DOT_FP32=dot_fp32,
        DOT_PRECISION=precision,
        CHANNEL=channel,
        ROTATE=rotate,
        LOG2_D=head_dim.bit_length() - 1,
        ROT_NORM=float(head_dim) ** -0.5,
        SPLIT=split,
        Q_CHUNK=tiles.q_chunk,
        PACKED=dt.packed,
        K_INT4=dt.side_bits(0) == 4,
        V_PLANE=dt.side_planes(1)[0],
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        enable_fp_fusion=True,
    )
    if split:
        merge_segments(part_m, part_l, part_acc, out, v_scale, num_kv_heads, channel, rotate)
    return out
