"""Torch reference for the paged KV-cache kernels; the engine's CPU path.

Layout (vLLM's Triton layout), one tensor per layer:

* ``kv_cache``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in the
  layer's storage dtype; index 0 of dim 1 is K, index 1 is V.
* ``scale_cache`` (dynamic per-token-head modes only):
  ``[num_blocks, 2, block_size, num_kv_heads]`` fp32.
* A *slot* is ``block_id * block_size + offset``; slot ``-1`` means "do not write".
* ``rotate=True`` (``--kv-rotation hadamard``): the cache holds ``K H`` and ``V H``
  (``H`` the normalized Hadamard matrix); attention rotates the query the same
  way and the output back, so its result is unchanged up to rounding.
* Static scales are ``[Hkv]`` or, for qkv's per-channel strategy, ``[Hkv, D]``
  (in the rotated basis when ``rotate``). Here they simply dequantize K and V;
  the Triton kernel folds them into the query and the output instead, which is
  the same arithmetic regrouped.

Attention is write-then-attend: callers write the step's new K/V first, then
every query token reads its whole context (new tokens included) back from the
cache, so quantization error is seen in prefill exactly as in decode.

Attention here runs one ``scaled_dot_product_attention`` call per sequence on
the dequantized context, choosing the same SDPA variants transformers' ``sdpa``
path uses (``is_causal`` for a full prefill, no mask for a single decode token,
an explicit boolean mask otherwise). That keeps the BF16 paged baseline
bit-compatible with ``transformers.generate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import CacheDtype, dequantize, dynamic_scales, hadamard_rotate, quantize

__all__ = ["write_kv_cache", "gather_kv", "paged_attention", "context_mask"]


def write_kv_cache(
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
    block_size = kv_cache.shape[2]
    if rotate:
        key, value = hadamard_rotate(key), hadamard_rotate(value)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    if dt.dynamic:
        assert scale_cache is not None, "dynamic modes need a scale cache"
        k_scale, v_scale = dynamic_scales(key, dt), dynamic_scales(value, dt)
        scale_cache[blocks, 0, offsets] = k_scale
        scale_cache[blocks, 1, offsets] = v_scale
    kv_cache[blocks, 0, offsets] = quantize(key, k_scale, dt)
    kv_cache[blocks, 1, offsets] = quantize(value, v_scale, dt)


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    dt: CacheDtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale_cache: torch.Tensor | None,
    out_dtype: torch.dtype,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read positions ``[start, length)`` of one sequence back as ``[L, Hkv, D]`` K and V.

    Only slots in ``[start, length)`` are returned: a reused block may hold stale
    bytes that decode to NaN (vLLM issue 47574), and they must never reach the
    softmax, so the block copy is trimmed before anything is dequantized.
    """
    block_size = kv_cache.shape[2]
    first, last = start // block_size, (length + block_size - 1) // block_size
    ids = block_table[first:last].long()
    # Whole blocks are copied with one index_select, then trimmed to [start, length).
    lo, hi = start - first * block_size, length - first * block_size
    blocks = kv_cache.index_select(0, ids)  # [n, 2, bs, H, D]
    k = blocks[:, 0].reshape(-1, *kv_cache.shape[3:])[lo:hi]
    v = blocks[:, 1].reshape(-1, *kv_cache.shape[3:])[lo:hi]
    if dt.dynamic:
        assert scale_cache is not None
        sc = scale_cache.index_select(0, ids)  # [n, 2, bs, H]
        k_scale = sc[:, 0].reshape(-1, sc.shape[-1])[lo:hi]
        v_scale = sc[:, 1].reshape(-1, sc.shape[-1])[lo:hi]
    return dequantize(k, k_scale, dt, out_dtype), dequantize(v, v_scale, dt, out_dtype)


def context_mask(
    q_len: int, start: int, seq_len: int, sliding_window: int | None, device: torch.device | None = None
) -> torch.Tensor:
    """Boolean ``[q_len, seq_len - start]`` mask: query i sits at position ``seq_len - q_len + i``.

    A key at position ``j`` is visible when ``j <= pos`` and, for sliding-window
    layers, ``j > pos - sliding_window`` (transformers' ``sliding_window_overlay``).
    """
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(start, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_attention(
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
    """Varlen paged attention over ``query`` ([T, Hq, D]); returns ``[T, Hq, D]`` in query's dtype.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``
    and has ``seq_lens[s]`` context tokens in the cache, its queries being the
    last ones. GQA is handled by SDPA's ``enable_gqa`` or by repeating heads when a
    mask is needed, as transformers does.
    """
    if rotate:  # (qH).(kH) = q.k; the output P(VH) is rotated back below
        out = paged_attention(
            hadamard_rotate(query).to(query.dtype),
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            dt,
            k_scale,
            v_scale,
            scale_cache,
            sm_scale,
            sliding_window,
        )
        return hadamard_rotate(out).to(query.dtype)
    out = torch.empty_like(query)
    num_q_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    groups = num_q_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        # Keys older than the window are invisible to every query of this step.
        start = 0
        if sliding_window is not None:
            start = max(0, seq_len - q_len - sliding_window + 1)
        k, v = gather_kv(
            kv_cache, block_tables[s], seq_len, dt, k_scale, v_scale, scale_cache, query.dtype, start=start
        )
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        kv_len = seq_len - start
        mask = None
        is_causal = False
        if q_len == kv_len and q_len > 1 and start == 0 and (sliding_window is None or kv_len <= sliding_window):
            is_causal = True
        elif q_len > 1 or (sliding_window is not None and kv_len > sliding_window):
            mask = context_mask(q_len, start, seq_len, sliding_window, query.device)
        if mask is None and groups > 1:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale, enable_gqa=True)
        else:
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=sm_scale)
        out[q0:q1] = o[0].transpose(0, 1)
    return out
