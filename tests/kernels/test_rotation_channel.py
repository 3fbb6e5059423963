"""Hadamard rotation and per-channel static scales in both kernels, against the torch reference.

Cache writes must be bit-exact (the Triton FWHT runs the reference's butterflies in
the same order); attention must match within 1e-3 (fp32 queries); and a rotated,
unquantized cache must give plain attention to within 1e-5. Without a GPU the
kernels run in Triton's interpreter.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402,F401 - a hard dependency (the test and triton extras): a missing one fails
from support.paged import paged_scenario, static_scales, write_step  # noqa: E402

from qkv.kernels import reference  # noqa: E402
from qkv.kernels.paged import PagedLayer  # noqa: E402
from qkv.kernels.quant import hadamard_rotate, quantize, resolve_cache_dtype  # noqa: E402
from qkv.kernels.triton_attention import triton_attend  # noqa: E402
from qkv.kernels.triton_cache_write import triton_write  # noqa: E402

SENTINEL = 0x5A


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


@pytest.mark.parametrize("d", [2, 16, 64, 128, 256])
def test_hadamard_rotate_is_the_orthonormal_hadamard_matrix(d):
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d)) * 7
    y = hadamard_rotate(x)
    assert y.dtype == torch.float32
    assert (y.double() - x.double() @ _sylvester(d)).abs().max().item() < 1e-5
    assert (hadamard_rotate(y) - x).abs().max().item() < 1e-5  # H is its own inverse
    # an outlier channel spreads evenly: |x_j| e_j -> |x_j| / sqrt(d) everywhere
    e = torch.zeros(1, 1, d)
    e[..., d // 3] = 100.0
    assert torch.allclose(hadamard_rotate(e).abs(), torch.full((1, 1, d), 100.0 / d**0.5))


def _write_both(name, granularity, rotate, num_heads=3, head_dim=64, num_tokens=11, seed=0, in_dtype=torch.float32):
    """The reference's write and the Triton kernel's, each into a fresh 6-block cache of sentinel bytes."""
    dt = resolve_cache_dtype(name)
    g = torch.Generator().manual_seed(seed)
    k_scale, v_scale = static_scales(name, granularity, num_heads, head_dim, g)
    # magnitudes spread over 2^-8 .. 2^6 so saturation, subnormals and ties all occur
    mag = torch.exp2(torch.randint(-8, 7, (2, num_tokens, num_heads, head_dim), generator=g).float())
    key, value = (torch.randn(2, num_tokens, num_heads, head_dim, generator=g) * mag).to(in_dtype)
    slots = torch.randperm(6 * 4, generator=g)[:num_tokens]
    slots[2] = -1
    out = []
    for fn, dev in ((reference.write, "cpu"), (triton_write, DEVICE)):
        raw = torch.full((6 * 2 * 4 * num_heads * head_dim * dt.itemsize,), SENTINEL, dtype=torch.uint8)
        cache = raw.view(dt.storage).view(6, 2, 4, num_heads, head_dim).to(dev)
        sc = torch.full((6, 2, 4, num_heads), -3.25, device=dev)

        def mv(t, dev=dev):
            return None if t is None else t.to(dev)

        layer = PagedLayer(cache, dt, mv(k_scale), mv(v_scale), sc if dt.dynamic else None, rotate)
        fn(layer, key.to(dev), value.to(dev), write_step(slots, dev))
        out.append((layer.kv.cpu(), sc.cpu()))
    return dt, key, value, k_scale, v_scale, slots, out


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize(
    "granularity,rotate", [("tensor", True), ("head", True), ("channel", False), ("channel", True)]
)
def test_static_write_bytes_identical(name, granularity, rotate):
    dt, key, value, k_scale, v_scale, slots, ((ref, _), (tri, _)) = _write_both(
        name, granularity, rotate, seed=sum(map(ord, name)) % 97
    )
    assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))
    # and the bytes are those of quantize(rotate(x)) with the scales broadcast per channel
    keep = slots >= 0
    k = hadamard_rotate(key) if rotate else key
    want = quantize(k[keep], k_scale, dt)
    s = slots[keep]
    assert torch.equal(ref[s // 4, 0, s % 4].view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[s] = False
    assert bool((ref.view(torch.uint8).transpose(1, 2).reshape(24, -1)[untouched] == SENTINEL).all())


@pytest.mark.parametrize("name", ["fp8_per_token_head", "int8_per_token_head", "bfloat16", "float32"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_rotated_dynamic_and_unquantized_bytes_identical(name, in_dtype):
    dt, *_, ((ref, ref_sc), (tri, tri_sc)) = _write_both(
        name, "tensor", True, num_heads=2, head_dim=128, seed=3, in_dtype=in_dtype
    )
    assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))
    assert torch.equal(ref_sc.view(torch.int32), tri_sc.view(torch.int32))


def test_rotation_with_head_dim_256_bytes_identical():
    *_, ((ref, _), (tri, _)) = _write_both("fp8_e4m3", "channel", True, num_heads=1, head_dim=256, seed=5)
    assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))


# -- attention ---------------------------------------------------------------------------------


def _attn_scenario(name, granularity, rotate, seq_lens, q_lens, **kw):
    """The shared paged scenario, with a hot K channel (the outliers real keys have)."""
    return paged_scenario(name, seq_lens, q_lens, granularity=granularity, rotate=rotate, hot_channel=True, **kw)


def _triton(sc):
    dev = sc.on(DEVICE)
    return triton_attend(dev.layer, dev.query, dev.meta, dev.sm_scale).cpu()


def _reference(sc):
    return reference.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize(
    "name,granularity,rotate",
    [
        ("fp8_e4m3", "tensor", True),
        ("fp8_e4m3", "head", True),
        ("fp8_e4m3", "channel", False),
        ("fp8_e4m3", "channel", True),
        ("int8", "channel", False),
        ("int8", "channel", True),
        ("int8", "head", True),
        ("int8_per_token_head", "tensor", True),
        ("fp8_per_token_head", "tensor", True),
        ("bfloat16", "tensor", True),
        ("float32", "tensor", True),
    ],
)
def test_attention_matches_reference(name, granularity, rotate):
    # prefill over a cached prefix, pure prefill, decodes, and a sequence without queries
    sc = _attn_scenario(name, granularity, rotate, [37, 20, 5, 9], [9, 20, 1, 0], seed=7)
    ref = _reference(sc)
    out = _triton(sc)
    assert bool(torch.isfinite(ref).all()) and bool(torch.isfinite(out).all())
    assert _rel(out, ref) < 1e-3


@pytest.mark.parametrize("window", [None, 6])
def test_attention_channel_rotation_head_dim_256_and_window(window):
    sc = _attn_scenario("int8", "channel", True, [40, 3], [12, 1], hq=4, hkv=1, d=256, window=window, seed=8)
    assert _rel(_triton(sc), _reference(sc)) < 1e-3


def test_attention_bf16_queries_with_rotation():
    sc = _attn_scenario("fp8_e4m3", "channel", True, [30, 7], [10, 1], seed=9, q_dtype=torch.bfloat16)
    assert _rel(_triton(sc), _reference(sc)) < 2e-2


@pytest.mark.parametrize("window", [None, 5])
def test_rotation_without_quantization_is_plain_attention(window):
    """An fp32 cache holding KH, VH gives the same attention as one holding K, V (to 1e-5)."""
    rotated = _attn_scenario("float32", "tensor", True, [33, 18, 4], [7, 18, 1], seed=10, window=window)
    plain = _attn_scenario("float32", "tensor", False, [33, 18, 4], [7, 18, 1], seed=10, window=window)
    assert torch.equal(rotated.query, plain.query)
    want = _reference(plain)
    for got in (_reference(rotated), _triton(rotated)):
        assert (got - want).abs().max().item() < 1e-5


def test_rotation_rejects_non_power_of_two_head_dim():
    """A rotated layer is refused when it is built, before either kernel could write it."""
    dt = resolve_cache_dtype("fp8_e4m3")
    cache = torch.zeros(2, 2, 4, 1, 48, dtype=dt.storage)
    s = torch.ones(1)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        PagedLayer(cache, dt, s, s, rotate=True)


def test_channel_scale_shape_is_checked():
    dt = resolve_cache_dtype("int8")
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=dt.storage)
    with pytest.raises(ValueError, match="per-channel k_scale"):
        PagedLayer(cache, dt, torch.ones(2, 8), torch.ones(2, 8))
