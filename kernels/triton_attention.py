"""Triton varlen paged attention over a (possibly quantized) paged KV cache.

Same signature and semantics as :func:`qkv.kernels.reference.paged_attention`:
sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``, its
queries are the last ``q_len`` of its ``seq_lens[s]`` context tokens, and query
``i`` sits at position ``seq_lens[s] - q_len + i``. One kernel covers prefill
(with or without a cached prefix), decode and mixed batches.

Launch grid: ``(num_tiles, num_kv_heads)``. A tile is up to ``BLOCK_Q`` consecutive
query tokens of one sequence; the host builds a per-program map ``tile -> (seq,
tile index in seq)``, so no program is wasted on padding in a mixed batch. A
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
rotated back before the store (:mod:`.triton_hadamard`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import CacheDtype, check_rotation
from .triton_hadamard import fwht_rows

__all__ = ["triton_paged_attention"]


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, scale_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_seq_ptr, tile_idx_ptr,
    sm_scale, window, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_sb, stride_skv, stride_ss,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr, DYNAMIC: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHANNEL: tl.constexpr, ROTATE: tl.constexpr, LOG2_D: tl.constexpr, ROT_NORM: tl.constexpr,
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
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if ROTATE:  # (qH).(kH) = q.k; rounded back to the query dtype like the reference
        q = fwht_rows(q.to(tl.float32), BLOCK_M, HEAD_DIM, LOG2_D, ROT_NORM).to(q_ptr.dtype.element_ty)
    q_dot = q
    if CHANNEL:  # fold the [D] K scale of this kv head into the query
        k_scale_ch = tl.load(k_scale_ptr + kv_head * HEAD_DIM + d)
        v_scale_ch = tl.load(v_scale_ptr + kv_head * HEAD_DIM + d)
        q_dot = (q.to(tl.float32) * k_scale_ch[None, :]).to(q.dtype)
    if DOT_FP32:
        q_dot = q_dot.to(tl.float32)

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

    for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_ok = (k_pos >= lo) & (k_pos < hi)
        # position -> slot through the block table (never past seq_len)
        block = tl.load(block_table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot_off = block * stride_cb + (k_pos % block_size) * stride_cs + kv_head * stride_ch
        kv_ptrs = cache_ptr + slot_off[:, None] + d[None, :]
        k = tl.load(kv_ptrs, mask=k_ok[:, None], other=0.0)
        v = tl.load(kv_ptrs + stride_ckv, mask=k_ok[:, None], other=0.0)
        if QUANTIZED:
            if DYNAMIC:
                s_ptrs = scale_cache_ptr + block * stride_sb + (k_pos % block_size) * stride_ss + kv_head
                k = k.to(tl.float32) * tl.load(s_ptrs, mask=k_ok, other=0.0)[:, None]
                v = v.to(tl.float32) * tl.load(s_ptrs + stride_skv, mask=k_ok, other=0.0)[:, None]
            elif CHANNEL:  # scales folded into the query and the output
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            else:
                k = k.to(tl.float32) * k_scale
                v = v.to(tl.float32) * v_scale
        # like the reference: dequantize to the query dtype, then multiply
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q_dot, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
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
        p = p.to(q.dtype).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if CHANNEL:
        acc = acc * v_scale_ch[None, :]
    if ROTATE:
        acc = fwht_rows(acc, BLOCK_M, HEAD_DIM, LOG2_D, ROT_NORM)
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _tile_sizes(group: int, max_q_len: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N): rows per tile, query tokens per tile, keys per K/V tile."""
    max_rows = 64 if head_dim <= 128 else 32
    block_m = max(16, triton.next_power_of_2(group))
    while block_m < max_rows and block_m < group * max_q_len:
        block_m *= 2
    block_n = 32 if head_dim <= 128 else 16
    return block_m, block_m // group, block_n


def triton_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, dt: CacheDtype,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           scale_cache: torch.Tensor | None, sm_scale: float,
                           sliding_window: int | None = None, rotate: bool = False) -> torch.Tensor:
    """Varlen paged attention over ``query`` ([T, Hq, D]); returns ``[T, Hq, D]`` in query's dtype.

    Static ``k_scale``/``v_scale`` are ``[Hkv]`` (or one element), or ``[Hkv, D]`` per channel.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [T, Hq, D], got {tuple(query.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, Hkv, {head_dim}], got {tuple(kv_cache.shape)}")
    num_blocks, _, block_size, num_kv_heads, _ = kv_cache.shape
    if kv_cache.dtype != dt.storage:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match {dt.name} storage {dt.storage}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (64, 128, 256), got {head_dim}")
    num_seqs = seq_lens.numel()
    if query_start_loc.numel() != num_seqs + 1 or block_tables.dim() != 2 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"need query_start_loc [{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks], "
                         f"got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")

    if dt.dynamic:
        expected = (num_blocks, 2, block_size, num_kv_heads)
        if scale_cache is None or tuple(scale_cache.shape) != expected or scale_cache.dtype != torch.float32:
            raise ValueError(f"{dt.name} needs a float32 scale_cache of shape {expected}")
        if scale_cache.stride(-1) != 1:
            raise ValueError("scale_cache must be contiguous in its last dimension")
        s_strides = scale_cache.stride()[:3]
    else:
        scale_cache, s_strides = kv_cache, (0, 0, 0)
    if rotate:
        check_rotation("hadamard", head_dim)
    channel = False
    if dt.quantized and not dt.dynamic:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{dt.name} needs k_scale and v_scale")
        channel = k_scale.dim() == 2 or v_scale.dim() == 2
    if channel:
        if tuple(k_scale.shape) != (num_kv_heads, head_dim) or tuple(v_scale.shape) != (num_kv_heads, head_dim):
            raise ValueError(f"per-channel k_scale/v_scale must both be [num_kv_heads={num_kv_heads}, "
                             f"head_dim={head_dim}], got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
        k_scale = k_scale.to(device=query.device, dtype=torch.float32).contiguous()
        v_scale = v_scale.to(device=query.device, dtype=torch.float32).contiguous()
    elif dt.quantized and not dt.dynamic:
        if k_scale.numel() not in (1, num_kv_heads) or v_scale.numel() not in (1, num_kv_heads):
            raise ValueError(f"k_scale/v_scale must have shape [num_kv_heads={num_kv_heads}] (or one element)")
        k_scale = k_scale.to(device=query.device, dtype=torch.float32).reshape(-1).expand(num_kv_heads).contiguous()
        v_scale = v_scale.to(device=query.device, dtype=torch.float32).reshape(-1).expand(num_kv_heads).contiguous()
    else:
        k_scale = v_scale = kv_cache  # unused placeholders

    query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    device = query.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    query_start_loc = query_start_loc.to(device=device, dtype=torch.int32)
    block_tables = block_tables.to(device=device, dtype=torch.int32)

    # Per-program map: tile -> (sequence, tile index within the sequence).
    group = num_q_heads // num_kv_heads
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    block_m, block_q, block_n = _tile_sizes(group, int(q_lens.max()), head_dim)
    tiles = (q_lens + block_q - 1) // block_q
    num_tiles = int(tiles.sum())
    if num_tiles == 0:
        return out
    tile_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device, dtype=torch.int32),
                                       tiles, output_size=num_tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_idx = (torch.arange(num_tiles, device=device) - first_tile[tile_seq]).to(torch.int32)

    # fp32 dots are IEEE; bf16/fp16 dots are native on a GPU. The interpreter
    # (CPU tensors) multiplies bf16 operands as raw uint16, so it upcasts them.
    dot_fp32 = query.dtype == torch.float32 or query.device.type == "cpu"
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        query, out, kv_cache, scale_cache, k_scale, v_scale,
        block_tables, seq_lens, query_start_loc, tile_seq, tile_idx,
        float(sm_scale), int(sliding_window or 0), block_size,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], *s_strides,
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        QUANTIZED=dt.quantized, DYNAMIC=dt.dynamic, USE_WINDOW=sliding_window is not None,
        DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32",  # no TF32 for fp32
        CHANNEL=channel, ROTATE=rotate, LOG2_D=head_dim.bit_length() - 1, ROT_NORM=float(head_dim) ** -0.5,
    )
    return out
