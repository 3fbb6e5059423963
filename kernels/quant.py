"""KV-cache storage dtypes and their quantize / dequantize semantics.

Every kernel (Triton or torch) follows the conventions written here, which are
vLLM's: ``q = x / s`` and ``x ~= q * s``; fp8 saturates to the largest finite
value instead of producing NaN/inf (vLLM writes with ``__NV_SATFINITE``); int8
is symmetric, rounds half to even and clamps to +-127 (-128 unused).

Static scales are handed to kernels as fp32 tensors of shape ``[num_kv_heads]``
(a per-tensor scale is broadcast to every head), so one code path serves both
compressed-tensors granularities, or ``[num_kv_heads, head_dim]`` for qkv's
per-channel extension (``channel``: the K scale is folded into the query and the
V scale into the output at attention time).

4-bit modes (``int4_per_token_head``, vLLM's name and size, not its grid: vLLM 0.32 quantizes
asymmetrically, 16 levels over each row's [min, max] after a randomized Hadamard transform;
``k8v4_per_token_head``, a qkv extension with K in int8): one fp32 scale per token and kv head, two values
a byte. An int4 side uses llama.cpp q4_0's *signed* grid: all 16 codes ``[-8, 7]``, and the scale carries
the sign of the row's largest-magnitude value, so that value lands on code -8 (``scale = -amax / 8`` when
it is positive, ``+amax / 8`` when negative). Against a symmetric ``[-7, 7]`` grid this is one more level
at the same bytes, and the read side is unchanged: ``x ~= code * scale``. Byte ``j`` of a packed row holds
channel ``j`` in its low nibble and channel ``j + D/2`` in its high nibble (two's complement): the low and
high halves of a row are then two contiguous runs of ``D/2`` values, so a kernel unpacks a tile with a mask
and a shift, no shuffle. The layout of such a cache is in :mod:`.paged`. A dynamic scale may be *clipped*:
``|scale| = amax / qmax * clip`` with a per-layer ratio ``clip <= 1`` chosen by ``qkv calibrate`` (1.0, the
plain absmax rule, when uncalibrated); values past the clipped range saturate.

Rotation (qkv extension, ``--kv-rotation hadamard``): K and V are multiplied by
the orthonormal Hadamard matrix ``H`` of size ``head_dim`` before they are
quantized. Attention is unchanged because ``q . k = (qH) . (kH)`` and the output
``P (VH) H^T = P V``; a rotation spreads single-channel outliers over every
channel, so a static scale fits the rotated values much better. The transform
is a fast Walsh-Hadamard transform in fp32 with a fixed butterfly order
(strides 1, 2, 4, ...), then one multiply by ``head_dim ** -0.5``; the Triton
kernels run the same additions in the same order, so cache bytes stay bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "CacheDtype",
    "resolve_cache_dtype",
    "CACHE_DTYPE_NAMES",
    "DYNAMIC_CACHE_DTYPES",
    "STATIC_CACHE_DTYPES",
    "STORAGE_DTYPES",
    "quantize",
    "dequantize",
    "dynamic_scales",
    "DYNAMIC_SCALE_FLOOR",
    "INT4_GRID",
    "PACKED_CACHE_DTYPES",
    "pack_int4",
    "unpack_int4",
    "ROTATIONS",
    "check_rotation",
    "hadamard_rotate",
    "rotation_norm",
]

ROTATIONS = ("none", "hadamard")

# How an int4 side's codes are placed; checkpoints of clipping ratios record it, since a ratio is chosen for
# one grid ("signed": q4_0's [-8, 7] with the scale's sign picking the side; qkv before it: symmetric [-7, 7]).
INT4_GRID = "signed"

# Smallest dynamic scale magnitude: an all-zero (token, head) row gets this scale, so
# quantization never divides by zero and the row still decodes to exact zeros.
DYNAMIC_SCALE_FLOOR = 1e-8


@dataclass(frozen=True)
class CacheDtype:
    """What one layer's KV cache stores and how.

    ``kind`` is ``"none"`` for an unquantized cache (bf16/fp16/fp32 copies of
    K/V), ``"float"`` for fp8 and ``"int"`` for int8. ``dynamic`` marks the
    per-token-head modes whose scales are computed at write time and stored
    beside the block.
    """

    name: str
    storage: torch.dtype
    kind: str
    qmax: float
    dynamic: bool = False
    # Bits per K and per V value when they are not the storage dtype's: 4 = packed int4, 8 = int8 bytes of a
    # packed cache (k8v4's K). 0: one storage element a value.
    k_bits: int = 0
    v_bits: int = 0

    @property
    def quantized(self) -> bool:
        return self.kind != "none"

    @property
    def packed(self) -> bool:
        """K or V is int4, two values a byte: the cache is laid out in half-row planes (:mod:`.paged`)."""
        return 4 in (self.k_bits, self.v_bits)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()

    def side_bits(self, kv: int) -> int:
        """Bits per value of K (``kv`` 0) or V (1) when it differs from the storage dtype's width, else 0."""
        return (self.k_bits, self.v_bits)[kv]

    def side_qmax(self, kv: int) -> float:
        """The largest code magnitude of K (``kv`` 0) or V (1), which a dynamic scale divides the row's absmax
        by: 8 for an int4 side (its signed grid's -8)."""
        return 8.0 if self.side_bits(kv) == 4 else self.qmax

    def side_codes(self, kv: int) -> tuple[float, float]:
        """The codes K (``kv`` 0) or V (1) clamps to: ``[-8, 7]`` for an int4 side, else ``[-qmax, qmax]``."""
        return (-8.0, 7.0) if self.side_bits(kv) == 4 else (-self.qmax, self.qmax)

    @property
    def planes(self) -> int:
        """Entries of the cache's dim 1: K and V (2), or for a packed cache, half-row planes of ``D/2`` bytes:
        an int4 side takes one, an int8 side two (K channels ``[0, D/2)`` then ``[D/2, D)``)."""
        return (self.k_bits + self.v_bits) // 4 if self.packed else 2

    def side_planes(self, kv: int) -> range:
        """Which planes of dim 1 hold K (``kv`` 0) or V (1)."""
        if not self.packed:
            return range(kv, kv + 1)
        k = self.k_bits // 4
        return range(0, k) if kv == 0 else range(k, self.planes)

    def row_elements(self, head_dim: int) -> int:
        """Storage elements along the cache's last dim: ``head_dim``, or ``head_dim / 2`` bytes when packed."""
        return head_dim // 2 if self.packed else head_dim

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's ``kv`` tensor (:mod:`.paged`)."""
        return (num_blocks, self.planes, block_size, num_kv_heads, self.row_elements(head_dim))

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes one token takes per kv head, K and V together, dynamic scales included."""
        return self.planes * self.row_elements(head_dim) * self.itemsize + self.scale_bytes_per_head

    @property
    def scale_bytes_per_head(self) -> int:
        """Bytes of dynamic-scale storage per token per kv head, for K and V together."""
        return 2 * 4 if self.dynamic else 0


_E4M3 = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_E5M2 = float(torch.finfo(torch.float8_e5m2).max)  # 57344

_DTYPES: dict[str, CacheDtype] = {
    "bfloat16": CacheDtype("bfloat16", torch.bfloat16, "none", 0.0),
    "float16": CacheDtype("float16", torch.float16, "none", 0.0),
    "float32": CacheDtype("float32", torch.float32, "none", 0.0),
    "fp8_e4m3": CacheDtype("fp8_e4m3", torch.float8_e4m3fn, "float", _E4M3),
    "fp8_e5m2": CacheDtype("fp8_e5m2", torch.float8_e5m2, "float", _E5M2),
    "int8": CacheDtype("int8", torch.int8, "int", 127.0),
    "fp8_per_token_head": CacheDtype("fp8_per_token_head", torch.float8_e4m3fn, "float", _E4M3, True),
    "int8_per_token_head": CacheDtype("int8_per_token_head", torch.int8, "int", 127.0, True),
    "int4_per_token_head": CacheDtype("int4_per_token_head", torch.uint8, "int", 7.0, True, 4, 4),
    "k8v4_per_token_head": CacheDtype("k8v4_per_token_head", torch.uint8, "int", 127.0, True, 8, 4),
}
_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}

CACHE_DTYPE_NAMES = (
    "auto",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "fp8_per_token_head",
    "int8_per_token_head",
    "int4_per_token_head",
    "k8v4_per_token_head",
)


def _kinds(static: bool) -> tuple[str, ...]:
    return tuple(
        n
        for n in CACHE_DTYPE_NAMES
        if n != "auto" and _DTYPES[_ALIASES.get(n, n)].quantized and _DTYPES[_ALIASES.get(n, n)].dynamic != static
    )


def resolve_cache_dtype(name: str, model_dtype: torch.dtype = torch.bfloat16) -> CacheDtype:
    """Map a ``--kv-cache-dtype`` value to its :class:`CacheDtype` (``auto`` = model dtype)."""
    key = _ALIASES.get(name, name)
    if key == "auto":
        key = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[model_dtype]
    if key not in _DTYPES:
        raise ValueError(f"unknown kv-cache dtype {name!r}; choose one of: {', '.join(CACHE_DTYPE_NAMES)}")
    return _DTYPES[key]


STORAGE_DTYPES = tuple(_DTYPES)  # every distinct cache dtype, by its canonical name (no aliases, no auto)
# The names of the two families, derived from the table above (so a new dtype joins its family by itself).
STATIC_CACHE_DTYPES = _kinds(static=True)  # one calibrated (or 1.0) scale per layer, head or channel
DYNAMIC_CACHE_DTYPES = _kinds(static=False)  # a scale per token and head, computed when the token is written
PACKED_CACHE_DTYPES = tuple(n for n in STORAGE_DTYPES if _DTYPES[n].packed)  # K or V in 4 bits


def check_rotation(rotation: str | None, head_dim: int) -> str | None:
    """``"hadamard"`` or ``None`` (for ``None``/``"none"``); a clear error for anything else.

    The Walsh-Hadamard transform exists for powers of two only; qkv implements no
    general orthogonal rotation, so other head sizes are refused up front.
    """
    if rotation in (None, "none"):
        return None
    if rotation != "hadamard":
        raise ValueError(f"unknown kv-cache rotation {rotation!r}; choose one of: {', '.join(ROTATIONS)}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(
            f"--kv-rotation hadamard needs a power-of-two head_dim, but this model's head_dim "
            f"is {head_dim}; use --kv-rotation none"
        )
    return rotation


def rotation_norm(head_dim: int) -> torch.Tensor:
    """The fp32 constant ``head_dim ** -0.5`` every implementation multiplies by."""
    return torch.tensor(float(head_dim) ** -0.5, dtype=torch.float32)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last dim in fp32 (``H`` the normalized Sylvester Hadamard matrix, ``H = H^T = H^-1``).

    Butterflies of stride 1, 2, 4, ..., D/2, each ``(a, b) -> (a + b, a - b)``,
    then one multiply by ``D ** -0.5``: the exact operation order the Triton
    kernels use, so both round identically.
    """
    d = x.shape[-1]
    check_rotation("hadamard", d)
    y = x.to(torch.float32)
    lead = y.shape[:-1]
    h = 1
    while h < d:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, d) * rotation_norm(d)


def _scale_view(scale: torch.Tensor, dt: CacheDtype) -> torch.Tensor:
    """Broadcast a scale over values ``[T, H, D]``.

    ``[H]`` (static per head/tensor) and ``[T, H]`` (dynamic) get a trailing
    axis; a static ``[H, D]`` per-channel scale already broadcasts.
    """
    scale = scale.to(torch.float32)
    if scale.dim() == 2 and not dt.dynamic:
        return scale
    return scale.unsqueeze(-1)


def quantize(x: torch.Tensor, scale: torch.Tensor, dt: CacheDtype, kv: int = 0) -> torch.Tensor:
    """Quantize ``x`` ([T, H, D]) with ``scale`` ([H], [H, D] or dynamic [T, H]) into ``dt.storage``.

    ``kv`` picks the side (0 K, 1 V) of a packed dtype, which returns its codes unpacked as int8
    (:func:`pack_int4` packs an int4 side).
    """
    if not dt.quantized:
        return x.to(dt.storage)
    y = x.to(torch.float32) / _scale_view(scale, dt)
    if dt.kind == "int":
        lo, hi = dt.side_codes(kv)
        return torch.round(y).clamp_(lo, hi).to(torch.int8)
    # NaN inputs stay NaN; finite values saturate like __NV_SATFINITE.
    return y.clamp(-dt.qmax, dt.qmax).to(dt.storage)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dt: CacheDtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize` (unpacked codes), computed in fp32 and cast to ``out_dtype``."""
    if not dt.quantized:
        return q.to(out_dtype)
    assert scale is not None
    return (q.to(torch.float32) * _scale_view(scale, dt)).to(out_dtype)


def dynamic_scales(x: torch.Tensor, dt: CacheDtype, kv: int = 0, clip: float = 1.0) -> torch.Tensor:
    """Per-(token, head) scales for the dynamic modes: ``amax(|x|, dim=-1) / qmax * clip``, floored.

    Every step is one fp32 operation in this order (the kernels repeat it); ``clip`` 1.0 changes no bit. An
    int4 side's scale is negated when the row's largest value is its absmax (``max(x) == amax``: a zero row
    too), so that the largest-magnitude value takes code -8 of the signed grid. The test is an equality of
    two maxima, not an argmax, so no back end depends on how it breaks ties.
    """
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scale = amax / dt.side_qmax(kv)
    if clip != 1.0:
        scale = scale * torch.tensor(clip, dtype=torch.float32)
    scale = torch.clamp(scale, min=DYNAMIC_SCALE_FLOOR)
    if dt.side_bits(kv) == 4:
        scale = torch.where(xf.amax(dim=-1) == amax, -scale, scale)
    return scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in ``[-8, 7]`` along the last dim ``D`` -> ``uint8`` ``[..., D/2]``: byte ``j`` holds channel
    ``j`` (low nibble) and ``j + D/2`` (high nibble)."""
    half = q.shape[-1] // 2
    lo, hi = q[..., :half].to(torch.int32), q[..., half:].to(torch.int32)
    return ((lo & 0xF) | ((hi & 0xF) << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8`` ``[..., D/2]`` -> int8 codes ``[..., D]`` (nibbles sign-extended)."""
    b = p.to(torch.int32)
    lo = ((b & 0xF) ^ 8) - 8
    hi = ((b >> 4) ^ 8) - 8
    return torch.cat((lo, hi), dim=-1).to(torch.int8)
