"""Triton kernel that quantizes new K/V and scatters them into the paged cache.

Byte-for-byte the same result as :func:`qkv.kernels.reference.write` (layout and conventions are documented
in ``paged.py`` and ``quant.py``).

Bit-exactness notes. The kernel never relies on a float cast to round:

* fp32 division uses ``tl.math.div_rn`` (IEEE round-to-nearest), because ``/`` may be
  approximate on a GPU.
* fp8: the value is clamped to +-qmax (saturating, NaN stays NaN) and rounded
  half-to-even onto the fp8 grid *in fp32*, subnormals included, so the final
  cast only re-encodes an exactly representable value. Triton 3.9's interpreter
  rounds fp32 -> float8e4nv wrongly when the rounding carries into the exponent
  (1.98 -> 1.0) and does not saturate (500 -> 256, 464 -> NaN). sm_80 has no fp8
  type at all: there (``FP8_NATIVE`` off) the cache is passed as raw ``uint8`` and the
  byte is built with integer arithmetic (:mod:`.triton_fp8`), equally bit-exact.
* int8: round-half-to-even with the ``1.5 * 2**23`` magic number (``libdevice.rint``
  does not exist in the interpreter), then an exact cast.
* bf16 copy: rounded half-to-even on the fp32 bits, because the interpreter
  truncates fp32 -> bf16.

* packed 4-bit caches (``PACKED``): the codes are int8's, clamped to each side's qmax; an int4 side's two
  halves are combined into bytes by an integer sum over a ``[H, 2, D/2]`` view (channel ``j`` + 16 x channel
  ``j + D/2``), an int8 side (k8v4's K) is stored as its two half-row planes.

One program writes one token (grid = ``(T,)``): all kv heads of K and V, plus their
dynamic scales; a ``-1`` slot masks every store of its program. ``ROTATE`` applies
the Hadamard rotation in registers first (:mod:`.triton_hadamard`, bit-exact with
the reference); ``CHANNEL`` loads a ``[Hkv, D]`` static scale tile instead of ``[Hkv]``.
FP fusion is pinned off for this kernel: its bytes must not depend on Triton's default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fp8_native, launch, target_arch
from .launch import unused_pointer as _unused
from .paged import PagedLayer, StepMetadata, check_kv
from .quant import DYNAMIC_SCALE_FLOOR
from .triton_fp8 import fp8_encode_bits, fp8_format, rint, round_to_fp8_grid
from .triton_hadamard import fwht_rows

__all__ = ["triton_write"]

DYNAMIC_FLOOR = tl.constexpr(DYNAMIC_SCALE_FLOOR)


@triton.jit
def _round_to_bf16(x):
    """Round fp32 ``x`` half-to-even to bf16 precision (result still fp32, exact in bf16)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _quantize(
    x,
    scale,
    KIND: tl.constexpr,
    QMAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    out_ty: tl.constexpr,
):
    """``x`` fp32 [BLOCK_H, BLOCK_D], ``scale`` fp32 [BLOCK_H, BLOCK_D] -> values of ``out_ty``.

    One constexpr branch per kind and nothing after it: Triton compiles the code that
    follows a constexpr ``return`` too, so an early return would still compile the fp8
    tail for a bf16 cache (and fail).
    """
    if KIND == 0:  # unquantized copy
        if ROUND_BF16:
            x = _round_to_bf16(x)
        out = x.to(out_ty)
    else:
        y = tl.math.div_rn(x, scale)
        y = tl.maximum(y, -QMAX, propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, QMAX, propagate_nan=tl.PropagateNan.ALL)
        if KIND == 1:  # int8: clamping first, then rounding, equals torch's round-then-clamp
            out = tl.where(y != y, 0.0, rint(y)).to(out_ty)  # NaN -> 0, as torch on CPU
        else:
            # NaN -> 0x7F / 0xFF (sign kept) like torch; the interpreter would write 384
            nan_byte = tl.where(y.to(tl.int32, bitcast=True) < 0, 0xFF, 0x7F).to(tl.uint8)
            r = round_to_fp8_grid(tl.where(y != y, 0.0, y), MANT_BITS, MIN_EXP)
            if FP8_NATIVE:  # sm_89+: the cast re-encodes an exact grid value
                q = r.to(out_ty).to(tl.uint8, bitcast=True)
            else:  # sm_80: the cache is raw uint8 and the byte is built with integers
                q = fp8_encode_bits(r, MANT_BITS, MIN_EXP)
            out = tl.where(y != y, nan_byte, q).to(out_ty, bitcast=True)
    return out


@triton.jit
def _pack_int4(q, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """int32 codes ``[BLOCK_H, BLOCK_D]`` in [-8, 7] -> ``uint8 [BLOCK_H, BLOCK_D / 2]``: byte ``j`` = channel ``j``
    (low nibble) | channel ``j + D/2`` (high nibble), as :func:`qkv.kernels.quant.pack_int4`."""
    nib = tl.reshape(q & 0xF, (BLOCK_H, 2, BLOCK_D // 2))
    weight = tl.where(tl.arange(0, 2) == 0, 1, 16)[None, :, None]
    return tl.sum(nib * weight, axis=1).to(tl.uint8)


@triton.jit
def _store_side(
    ptr,
    x,
    scale,
    h,
    h_ok,
    QMAX: tl.constexpr,
    INT4: tl.constexpr,
    hi_off,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    stride_ch,
):
    """One side of a packed cache: codes clamped to ``[-QMAX, QMAX]`` (int8) or the signed grid ``[-8, 7]``
    (int4, ``QMAX`` 8), stored as an int4 plane or two int8 half-row planes (channels ``[D/2, D)`` ``hi_off``
    bytes after the row)."""
    y = tl.math.div_rn(x, scale)
    y = tl.maximum(y, -QMAX, propagate_nan=tl.PropagateNan.ALL)
    y = tl.minimum(y, QMAX - 1.0 if INT4 else QMAX, propagate_nan=tl.PropagateNan.ALL)
    q = tl.where(y != y, 0.0, rint(y)).to(tl.int32)  # NaN -> 0, as torch on CPU
    if INT4:
        half = tl.arange(0, BLOCK_D // 2)
        tl.store(ptr + h[:, None] * stride_ch + half[None, :], _pack_int4(q, BLOCK_H, BLOCK_D), mask=h_ok[:, None])
    else:
        d = tl.arange(0, BLOCK_D)
        off = tl.where(d < BLOCK_D // 2, d, d - BLOCK_D // 2 + hi_off)
        tl.store(
            ptr + h[:, None] * stride_ch + off[None, :], q.to(tl.int8).to(tl.uint8, bitcast=True), mask=h_ok[:, None]
        )


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_cache_ptr,
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_skv,
    stride_ss,
    k_clip,
    v_clip,
    k_hi,
    KIND: tl.constexpr,
    DYNAMIC: tl.constexpr,
    QMAX: tl.constexpr,
    V_QMAX: tl.constexpr,
    PACKED: tl.constexpr,
    K_INT4: tl.constexpr,
    V_PLANE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ROTATE: tl.constexpr,
    LOG2_D: tl.constexpr,
    ROT_NORM: tl.constexpr,
    CHANNEL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.where(slot >= 0, num_heads, 0)  # slot -1: padding token, store nothing
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE  # a constexpr: the paged layout's block size, a shift for 16
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < heads
    mask = h_ok[:, None] & (d[None, :] < head_dim)
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if ROTATE:  # BLOCK_D == head_dim (a power of two); padded heads are zero rows
        k = fwht_rows(k, BLOCK_H, BLOCK_D, LOG2_D, ROT_NORM)
        v = fwht_rows(v, BLOCK_H, BLOCK_D, LOG2_D, ROT_NORM)

    if KIND == 0:
        k_scale = tl.full((BLOCK_H, BLOCK_D), 1.0, tl.float32)
        v_scale = k_scale
    elif DYNAMIC:
        # amax(|x|) / qmax * clip, floored; stored beside the block (a clip of 1.0 multiplies exactly)
        k_amax = tl.max(tl.abs(k), axis=1)
        v_amax = tl.max(tl.abs(v), axis=1)
        k_scale = tl.maximum(tl.math.div_rn(k_amax, tl.full((BLOCK_H,), QMAX, tl.float32)) * k_clip, DYNAMIC_FLOOR)
        v_scale = tl.maximum(tl.math.div_rn(v_amax, tl.full((BLOCK_H,), V_QMAX, tl.float32)) * v_clip, DYNAMIC_FLOOR)
        # an int4 side's signed grid: a positive extreme (or a zero row) takes code -8, so its scale flips;
        # padded channels load 0, which equals amax only in a zero row, as the reference's max does
        if PACKED:
            v_scale = tl.where(tl.max(v, axis=1) == v_amax, -v_scale, v_scale)
            if K_INT4:
                k_scale = tl.where(tl.max(k, axis=1) == k_amax, -k_scale, k_scale)
        s_base = scale_cache_ptr + block * stride_sb + offset * stride_ss + h
        tl.store(s_base, k_scale, mask=h_ok)
        tl.store(s_base + stride_skv, v_scale, mask=h_ok)
        k_scale = tl.broadcast_to(k_scale[:, None], (BLOCK_H, BLOCK_D))
        v_scale = tl.broadcast_to(v_scale[:, None], (BLOCK_H, BLOCK_D))
    elif CHANNEL:  # [Hkv, D] static scales, contiguous
        k_scale = tl.load(k_scale_ptr + h[:, None] * head_dim + d[None, :], mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + h[:, None] * head_dim + d[None, :], mask=mask, other=1.0)
    else:
        k_scale = tl.broadcast_to(tl.load(k_scale_ptr + h, mask=h_ok, other=1.0)[:, None], (BLOCK_H, BLOCK_D))
        v_scale = tl.broadcast_to(tl.load(v_scale_ptr + h, mask=h_ok, other=1.0)[:, None], (BLOCK_H, BLOCK_D))

    if PACKED:  # dynamic by construction; V is int4 in plane V_PLANE, K int4 or int8 from plane 0
        row = cache_ptr + block * stride_cb + offset * stride_cs
        _store_side(row, k, k_scale, h, h_ok, QMAX, K_INT4, k_hi, BLOCK_H, BLOCK_D, stride_ch)
        _store_side(row + V_PLANE * stride_ckv, v, v_scale, h, h_ok, V_QMAX, True, 0, BLOCK_H, BLOCK_D, stride_ch)
    else:
        out_ty = cache_ptr.dtype.element_ty
        kq = _quantize(k, k_scale, KIND, QMAX, MANT_BITS, MIN_EXP, FP8_NATIVE, ROUND_BF16, out_ty)
        vq = _quantize(v, v_scale, KIND, QMAX, MANT_BITS, MIN_EXP, FP8_NATIVE, ROUND_BF16, out_ty)
        c_base = cache_ptr + block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
        tl.store(c_base, kq, mask=mask)
        tl.store(c_base + stride_ckv, vq, mask=mask)


def triton_write(layer: PagedLayer, key: torch.Tensor, value: torch.Tensor, meta: StepMetadata) -> None:
    """Quantize ``key``/``value`` ([T, Hkv, D]) and scatter them into the layer's cache at the step's slots."""
    check_kv(layer, key, value, meta)
    kv_cache, dt = layer.kv, layer.dt
    num_tokens, num_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value), ("slot_mapping", meta.slot_mapping)):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if num_tokens == 0:
        return
    unused = _unused(kv_cache.device)
    k_scale = layer.k_scale if layer.k_scale is not None else unused
    v_scale = layer.v_scale if layer.v_scale is not None else unused
    scale_cache = layer.scale_cache if layer.scale_cache is not None else unused
    s_strides = layer.scale_cache.stride()[:3] if layer.scale_cache is not None else (0, 0, 0)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    mant_bits, min_exp = fp8_format(dt.storage)
    native = fp8_native(target_arch(kv_cache.device))
    cache_arg = kv_cache if native or dt.kind != "float" else kv_cache.view(torch.uint8)
    launch(
        _write_kv_kernel,
        (num_tokens,),
        key,
        value,
        cache_arg,
        meta.slot_mapping,
        k_scale,
        v_scale,
        scale_cache,
        num_heads,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv_cache.stride()[:4],
        *s_strides,
        float(layer.k_clip),
        float(layer.v_clip),
        kv_cache.stride(1),  # k8v4's K: channels [D/2, D) are one plane further
        KIND={"none": 0, "int": 1, "float": 2}[dt.kind],
        DYNAMIC=dt.dynamic,
        QMAX=float(dt.side_qmax(0)),
        V_QMAX=float(dt.side_qmax(1)),
        PACKED=dt.packed,
        K_INT4=dt.side_bits(0) == 4,
        V_PLANE=dt.side_planes(1)[0],
        MANT_BITS=mant_bits,
        MIN_EXP=min_exp,
        FP8_NATIVE=native,
        ROUND_BF16=dt.storage == torch.bfloat16,
        ROTATE=layer.rotate,
        LOG2_D=head_dim.bit_length() - 1,
        ROT_NORM=float(head_dim) ** -0.5,
        CHANNEL=layer.channel,
        BLOCK_SIZE=layer.block_size,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=False,  # pinned: the bytes must not depend on Triton's default (it changes in 3.10)
    )
