"""Torch reference for the paged KV-cache kernels: the specification the fused kernels are tested against.

The cache layout and what a layer and a step hand over are in :mod:`.paged`. Attention is write-then-attend:
callers write the step's new K/V first, then every query token reads its whole context (new tokens included)
back from the cache, so quantization error is seen in prefill exactly as in decode.

Static scales simply dequantize K and V here; the Triton kernel folds them into the query and the output
instead, which is the same arithmetic regrouped.

Attention runs one ``scaled_dot_product_attention`` call per sequence on the dequantized context, choosing the
same SDPA variants transformers' ``sdpa`` path uses for a prompt alone (``is_causal`` for a full prefill, no
mask for a single decode token, an explicit boolean mask otherwise), so that an fp32 paged baseline gives
``transformers.generate``'s tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged import PagedLayer, StepMetadata, check_kv, check_query
from .quant import CacheDtype, dequantize, dynamic_scales, hadamard_rotate, pack_int4, quantize, unpack_int4

__all__ = ["TorchReference", "attend", "attend_dense", "context_mask", "gather_kv", "visible_start", "write"]


def write(layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None:
    """Quantize ``key``/``value`` ([T, Hkv, D]) and scatter them into the layer's cache at the step's slots."""
    check_kv(layer, key, value, meta)
    dt, slots = layer.dt, meta.slot_mapping
    if layer.rotate:
        key, value = hadamard_rotate(key), hadamard_rotate(value)
    if meta.write_rows is not None:  # tokens with slot -1 are not written
        key, value, slots = key[meta.write_rows], value[meta.write_rows], slots[meta.write_rows]
    if slots.numel() == 0:
        return
    block_size = layer.block_size
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_scale, v_scale = layer.k_scale, layer.v_scale
    if dt.dynamic:
        assert layer.scale_cache is not None
        k_scale, v_scale = dynamic_scales(key, dt, 0, layer.k_clip), dynamic_scales(value, dt, 1, layer.v_clip)
        layer.scale_cache[blocks, 0, offsets] = k_scale
        layer.scale_cache[blocks, 1, offsets] = v_scale
    for kv, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        planes = to_planes(quantize(x, scale, dt, kv), dt, kv)
        for p, plane in zip(dt.side_planes(kv), planes):
            layer.kv[blocks, p, offsets] = plane


def to_planes(q: torch.Tensor, dt: CacheDtype, kv: int) -> list[torch.Tensor]:
    """One side's stored values (``[..., D]``, codes as :func:`quantize` returns them) as the rows of its
    planes (:mod:`.paged`): the values themselves, one packed int4 plane, or an int8 side's two halves."""
    if dt.side_bits(kv) == 4:
        return [pack_int4(q)]
    if dt.packed:
        half = q.shape[-1] // 2
        raw = q.view(torch.uint8)
        return [raw[..., :half], raw[..., half:]]
    return [q]


def from_planes(planes: list[torch.Tensor], dt: CacheDtype, kv: int) -> torch.Tensor:
    """Inverse of :func:`to_planes`: a side's plane rows back to values or codes ``[..., D]``."""
    if dt.side_bits(kv) == 4:
        return unpack_int4(planes[0])
    if dt.packed:
        return torch.cat(planes, dim=-1).view(torch.int8)
    return planes[0]


def gather_kv(
    layer: PagedLayer, block_table: torch.Tensor, length: int, out_dtype: torch.dtype, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read positions ``[start, length)`` of one sequence back as ``[L, Hkv, D]`` K and V.

    Only slots in ``[start, length)`` are returned: a reused block may hold stale
    bytes that decode to NaN (vLLM issue 47574), and they must never reach the
    softmax, so the block copy is trimmed before anything is dequantized.
    """
    kv_cache, dt, block_size = layer.kv, layer.dt, layer.block_size
    first, last = start // block_size, (length + block_size - 1) // block_size
    ids = block_table[first:last].long()
    # Whole blocks are copied with one index_select, then trimmed to [start, length).
    lo, hi = start - first * block_size, length - first * block_size
    blocks = kv_cache.index_select(0, ids)  # [n, planes, bs, H, D or D / 2]
    k, v = (
        from_planes([blocks[:, p].reshape(-1, *kv_cache.shape[3:])[lo:hi] for p in dt.side_planes(kv)], dt, kv)
        for kv in (0, 1)
    )
    k_scale, v_scale = layer.k_scale, layer.v_scale
    if dt.dynamic:
        assert layer.scale_cache is not None
        sc = layer.scale_cache.index_select(0, ids)  # [n, 2, bs, H]
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


def attend(layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float) -> torch.Tensor:
    """Varlen paged attention over ``query`` ([T, Hq, D]); returns ``[T, Hq, D]`` in query's dtype.

    GQA is handled by SDPA's ``enable_gqa`` or by repeating heads when a mask is needed, as transformers does.
    """
    check_query(layer, query, meta)
    if layer.rotate:  # (qH).(kH) = q.k; the output P(VH) is rotated back below
        out = _attend(layer, hadamard_rotate(query).to(query.dtype), meta, sm_scale)
        return hadamard_rotate(out).to(query.dtype)
    return _attend(layer, query, meta, sm_scale)


def _attend(layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    window = layer.sliding_window
    qsl = meta.query_start_host
    for s, seq_len in enumerate(meta.seq_lens_host):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        start = visible_start(seq_len, q1 - q0, window)
        k, v = gather_kv(layer, meta.block_tables[s], seq_len, query.dtype, start=start)
        out[q0:q1] = attend_dense(query[q0:q1], k.transpose(0, 1), v.transpose(0, 1), start, seq_len, window, sm_scale)
    return out


def visible_start(seq_len: int, q_len: int, window: int | None) -> int:
    """The first key position any of the step's ``q_len`` queries sees: keys older than the window are
    invisible to every one of them."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def attend_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: int,
    seq_len: int,
    window: int | None,
    sm_scale: float,
) -> torch.Tensor:
    """One sequence's queries (``[q_len, Hq, D]``, the last of its ``seq_len`` positions) over its contiguous
    keys and values of positions ``[start, seq_len)`` (``[Hkv, L, D]``), with the SDPA variant transformers
    picks: ``is_causal`` for a whole prefill, no mask for a decode, an explicit mask otherwise."""
    q_len = query.shape[0]
    groups = query.shape[1] // key.shape[0]
    q, k, v = query.transpose(0, 1).unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    kv_len = seq_len - start
    mask = None
    is_causal = False
    if q_len == kv_len and q_len > 1 and start == 0 and (window is None or kv_len <= window):
        is_causal = True
    elif q_len > 1 or (window is not None and kv_len > window):
        mask = context_mask(q_len, start, seq_len, window, query.device)
    if mask is None and groups > 1:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale, enable_gqa=True)
    else:
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=sm_scale)
    return o[0].transpose(0, 1)


class TorchReference:
    """The reference as a back end (``--attention-backend torch``): one SDPA call per sequence."""

    name = "torch"

    def prepare(self, layer: PagedLayer) -> None:
        """The reference runs every layer :class:`~.paged.PagedLayer` accepts."""

    def write(self, layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None:
        write(layer, key, value, meta)

    def attend(self, layer: PagedLayer, query: torch.Tensor, meta: StepMetadata, sm_scale: float) -> torch.Tensor:
        return attend(layer, query, meta, sm_scale)
