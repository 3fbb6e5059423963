"""Split-KV (flash-decoding) for paged decode: how many segments, and the log-sum-exp merge.

Why: the attention grid is (query tiles, kv heads). A batch-1 decode on a model with 8
kv heads starts 8 programs, and each walks the whole context alone, while an H200
has 132 SMs; at long context that leaves almost all of its HBM bandwidth unused.
For decode-only batches the attention kernel therefore also splits each sequence's
visible keys into ``num_segments`` contiguous runs of whole key tiles (grid axis 2),
and every program writes an *unnormalized* partial result: its running max ``m``,
its softmax denominator ``l`` and its accumulator ``acc = sum_j exp(s_j - m) v_j``.
:func:`merge_segments` then combines them exactly (vLLM's ``reduce_segments``)::

    M = max_s m_s,   out = (sum_s exp(m_s - M) acc_s) / (sum_s exp(m_s - M) l_s)

and applies what the unsplit kernel applies at its end: the per-channel V scale and
the inverse Hadamard rotation. An empty segment has ``m = -inf`` and weight 0.

:func:`num_kv_segments` picks the segment count: one segment while ``seqs x kv_heads``
already gives every SM a program, otherwise enough segments to reach ``num_sms``
programs, but never segments shorter than :data:`MIN_KEYS_PER_SEGMENT` keys (the merge
and the partial results cost more than they save on short contexts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .triton_hadamard import fwht_rows

__all__ = ["num_kv_segments", "merge_segments", "partial_buffers", "MIN_KEYS_PER_SEGMENT", "MAX_SEGMENTS"]

MIN_KEYS_PER_SEGMENT = 256
MAX_SEGMENTS = 64


def num_kv_segments(num_seqs: int, num_kv_heads: int, context: int, num_sms: int) -> int:
    """Segments per (sequence, kv head) for a decode over at most ``context`` visible keys."""
    base = num_seqs * num_kv_heads
    if base <= 0 or base >= num_sms:
        return 1
    wanted = triton.cdiv(num_sms, base)
    affordable = max(1, context // MIN_KEYS_PER_SEGMENT)
    return max(1, min(wanted, affordable, MAX_SEGMENTS))


@triton.jit
def _merge_segments_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    v_scale_ptr,
    num_segments,
    num_q_heads,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHANNEL: tl.constexpr,
    ROTATE: tl.constexpr,
    LOG2_D: tl.constexpr,
    ROT_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    # partial results are [T, Hq, num_segments] (m, l) and [T, Hq, num_segments, D] (acc)
    row = (token * num_q_heads + head) * num_segments

    m_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for s in range(num_segments):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + row + s, mask=g_ok, other=float("-inf")))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    for s in range(num_segments):
        w = tl.exp(tl.load(part_m_ptr + row + s, mask=g_ok, other=float("-inf")) - m_safe)
        l_sum += w * tl.load(part_l_ptr + row + s, mask=g_ok, other=0.0)
        a = tl.load(part_acc_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=g_ok[:, None], other=0.0)
        acc += w[:, None] * a

    acc = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    if CHANNEL:  # the V scale is folded into the output, as in the unsplit kernel
        acc = acc * tl.load(v_scale_ptr + kv_head * HEAD_DIM + d)[None, :]
    if ROTATE:
        acc = fwht_rows(acc, BLOCK_G, HEAD_DIM, LOG2_D, ROT_NORM)
    out_ptrs = out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def partial_buffers(
    num_tokens: int, num_q_heads: int, num_segments: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``m``, ``l`` ``[T, Hq, S]`` and ``acc`` ``[T, Hq, S, D]`` for the segments' partial results."""
    m = torch.empty(num_tokens, num_q_heads, num_segments, device=device, dtype=torch.float32)
    return m, torch.empty_like(m), torch.empty(*m.shape, head_dim, device=device, dtype=torch.float32)


def merge_segments(
    part_m: torch.Tensor,
    part_l: torch.Tensor,
    part_acc: torch.Tensor,
    out: torch.Tensor,
    v_scale: torch.Tensor,
    num_kv_heads: int,
    channel: bool,
    rotate: bool,
) -> None:
    """Combine the segments' partial results into ``out`` ``[T, Hq, D]`` (grid: tokens x kv heads)."""
    num_tokens, num_q_heads, num_segments = part_m.shape
    head_dim = out.shape[-1]
    group = num_q_heads // num_kv_heads
    launch(
        _merge_segments_kernel,
        (num_tokens, num_kv_heads),
        part_m,
        part_l,
        part_acc,
        out,
        v_scale,
        num_segments,
        num_q_heads,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        CHANNEL=channel,
        ROTATE=rotate,
        LOG2_D=head_dim.bit_length() - 1,
        ROT_NORM=float(head_dim) ** -0.5,
        enable_fp_fusion=True,  # pinned: Triton 3.10 changes the default
    )
