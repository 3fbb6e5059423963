"""fp8 e4m3 / e5m2 in Triton: grid rounding, and encode / decode either native or by integer arithmetic.

Why integer arithmetic: Triton's ``fp8e4nv`` type (e4m3) needs sm_89 or newer, and sm_80
(A100) has no fp8 conversion instructions at all, so a kernel that casts to or from fp8
does not compile for Ampere. On those GPUs the launchers hand the cache to the kernels
as raw ``uint8`` and the helpers below build the bytes and the fp32 values with integer
operations. Both directions are exact, bit for bit, against torch's ``float8_e4m3fn`` /
``float8_e5m2`` (every one of the 256 byte values decodes to torch's fp32 bits, NaN
payloads included); the tests prove it under the interpreter.

Where the GPU has the conversion (sm_89+) the kernels use it (``NATIVE``). Encoding
never relies on a cast to *round*: :func:`round_to_fp8_grid` puts the value exactly on
the fp8 grid in fp32 first, so the native cast and :func:`fp8_encode_bits` only
re-encode an exactly representable value (this also sidesteps Triton 3.9's
interpreter, whose fp32 -> fp8 cast rounds wrongly on exponent carry and does not
saturate). The interpreter's fp8 -> fp32 cast is also wrong for the NaN/inf bytes
(0x7F decodes to 480), which never reach a softmax; the integer path has no such gap.

Formats are described by two constexprs: ``MANT_BITS`` (3 for e4m3, 2 for e5m2) and
``MIN_EXP``, the exponent of the smallest normal (-6, -14). The exponent bias is
``1 - MIN_EXP``; e4m3 (``fn``) has no infinity and NaN only at magnitude 0x7F, e5m2 is
IEEE-like (exponent all ones: infinity or NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FP8_FORMATS", "fp8_format", "round_to_fp8_grid", "fp8_encode_bits", "fp8_decode_bits", "rint", "RINT_MAGIC"]

# (MANT_BITS, MIN_EXP) of each fp8 storage dtype
FP8_FORMATS: dict[torch.dtype, tuple[int, int]] = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}

RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + M) - M rounds half-to-even for |x| < 2**22


def fp8_format(storage: torch.dtype) -> tuple[int, int]:
    """``(MANT_BITS, MIN_EXP)`` of an fp8 storage dtype; ``(0, 0)`` for any other dtype."""
    return FP8_FORMATS.get(storage, (0, 0))


@triton.jit
def rint(x):
    """Round fp32 ``x`` (|x| < 2**22) to the nearest integer, ties to even."""
    return (x + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def _pow2(E: tl.constexpr):
    """The fp32 scalar ``2**E`` (E a normal exponent), built from its bits so it is exact."""
    return tl.full([], (E + 127) << 23, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round fp32 ``y`` (already clamped to +-qmax) half-to-even onto an fp8 grid.

    The grid spacing (ulp) at ``|y|`` is ``2**(max(e, MIN_EXP) - MANT_BITS)`` with
    ``e = floor(log2|y|)``; below the smallest normal ``2**MIN_EXP`` it is the
    subnormal step. Scaling by a power of two is exact, so the result is exactly
    representable in the fp8 format.
    """
    bits = y.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, MIN_EXP) - MANT_BITS
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    r = rint(tl.abs(y) * inv_ulp) * ulp
    return tl.where(bits < 0, -r, r)  # keeps the sign of -0.0 and of tiny negatives


@triton.jit
def fp8_encode_bits(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``y`` exactly on the fp8 grid (finite, not NaN, ``|y| <= qmax``) -> its fp8 byte (``uint8``).

    Normal values keep their fp32 mantissa's top ``MANT_BITS`` bits and have the exponent
    re-biased (one integer subtract and shift); subnormals are the integer
    ``|y| / 2**(MIN_EXP - MANT_BITS)``, exact because ``y`` is on the grid.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    normal = (a_bits - ((126 + MIN_EXP) << 23)) >> (23 - MANT_BITS)  # bias 1 - MIN_EXP
    sub_scale = _pow2(MANT_BITS - MIN_EXP)
    min_normal = _pow2(MIN_EXP)
    # clamped so that the float -> int conversion never overflows on the normal branch
    sub = (tl.minimum(a_bits.to(tl.float32, bitcast=True), min_normal) * sub_scale).to(tl.int32)
    mag = tl.where((a_bits >> 23) >= 127 + MIN_EXP, normal, sub)
    return (mag | sign).to(tl.uint8)


@triton.jit
def fp8_decode_bits(b, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp8 bytes ``b`` (``uint8``) -> fp32 with torch's exact bits, by integer arithmetic.

    A normal byte's exponent and mantissa, shifted into fp32's fields, only need the
    exponent re-biased; a subnormal is its mantissa integer times ``2**(MIN_EXP -
    MANT_BITS)`` (exact, and never an fp32 subnormal, so no flush-to-zero can touch it).
    Specials get torch's bits: infinity, or a quiet NaN that keeps the mantissa as payload.
    """
    x = b.to(tl.int32) & 0xFF
    sign = (x & 0x80) << 24
    mag = x & 0x7F
    e = mag >> MANT_BITS
    m = mag & ((1 << MANT_BITS) - 1)
    normal = (mag << (23 - MANT_BITS)) + ((126 + MIN_EXP) << 23)  # fp32 bias 127 - fp8 bias (1 - MIN_EXP)
    sub_step = _pow2(MIN_EXP - MANT_BITS)
    sub = (m.to(tl.float32) * sub_step).to(tl.int32, bitcast=True)
    if MANT_BITS == 3:  # e4m3fn: no infinity, NaN only at magnitude 0x7F
        special = mag == 0x7F
    else:  # e5m2: exponent all ones -> infinity (m == 0) or NaN
        special = e == (1 << (7 - MANT_BITS)) - 1
    special_bits = 0x7F800000 | (m << (23 - MANT_BITS)) | tl.where(m != 0, 0x400000, 0)
    bits = tl.where(special, special_bits, tl.where(e == 0, sub, normal))
    return (bits | sign).to(tl.float32, bitcast=True)
