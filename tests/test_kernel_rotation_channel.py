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

from qkv.kernels.quant import hadamard_rotate, quantize, resolve_cache_dtype  # noqa: E402
from qkv.kernels.reference import paged_attention, write_kv_cache  # noqa: E402
from qkv.kernels.triton_attention import triton_paged_attention  # noqa: E402
from qkv.kernels.triton_cache_write import triton_write_kv_cache  # noqa: E402

SENTINEL = 0x5A


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5


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
    assert torch.allclose(hadamard_rotate(e).abs(), torch.full((1, 1, d), 100.0 / d ** 0.5))


def _scales(name, granularity, h, d, g):
    dt = resolve_cache_dtype(name)
    if not dt.quantized or dt.dynamic:
        return None, None
    base = 0.02 if dt.kind == "float" else 0.04
    if granularity == "head":
        return torch.rand(h, generator=g) * base + base / 2, torch.rand(h, generator=g) * base + base / 2
    if granularity == "channel":
        return torch.rand(h, d, generator=g) * base + base / 2, torch.rand(h, d, generator=g) * base + base / 2
    return torch.full((h,), base), torch.full((h,), base * 0.7)


def _write_both(name, granularity, rotate, num_heads=3, head_dim=64, num_tokens=11, seed=0,
                in_dtype=torch.float32):
    dt = resolve_cache_dtype(name)
    g = torch.Generator().manual_seed(seed)
    k_scale, v_scale = _scales(name, granularity, num_heads, head_dim, g)
    # magnitudes spread over 2^-8 .. 2^6 so saturation, subnormals and ties all occur
    mag = torch.exp2(torch.randint(-8, 7, (2, num_tokens, num_heads, head_dim), generator=g).float())
    key, value = (torch.randn(2, num_tokens, num_heads, head_dim, generator=g) * mag).to(in_dtype)
    slots = torch.randperm(6 * 4, generator=g)[:num_tokens]
    slots[2] = -1
    out = []
    for fn, dev in ((write_kv_cache, "cpu"), (triton_write_kv_cache, DEVICE)):
        raw = torch.full((6 * 2 * 4 * num_heads * head_dim * dt.itemsize,), SENTINEL, dtype=torch.uint8)
        cache = raw.view(dt.storage).view(6, 2, 4, num_heads, head_dim).to(dev)
        sc = torch.full((6, 2, 4, num_heads), -3.25, device=dev)
        mv = (lambda t: None if t is None else t.to(dev))
        fn(key.to(dev), value.to(dev), cache, slots.to(dev), dt, mv(k_scale), mv(v_scale), sc, rotate=rotate)
        out.append((cache.cpu(), sc.cpu()))
    return dt, key, value, k_scale, v_scale, slots, out


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("granularity,rotate", [("tensor", True), ("head", True), ("channel", False),
                                                ("channel", True)])
def test_static_write_bytes_identical(name, granularity, rotate):
    dt, key, value, k_scale, v_scale, slots, ((ref, _), (tri, _)) = _write_both(name, granularity, rotate,
                                                                                 seed=hash(name) % 97)
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
    dt, *_, ((ref, ref_sc), (tri, tri_sc)) = _write_both(name, "tensor", True, num_heads=2, head_dim=128,
                                                         seed=3, in_dtype=in_dtype)
    assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))
    assert torch.equal(ref_sc.view(torch.int32), tri_sc.view(torch.int32))


def test_rotation_with_head_dim_256_bytes_identical():
    *_, ((ref, _), (tri, _)) = _write_both("fp8_e4m3", "channel", True, num_heads=1, head_dim=256, seed=5)
    assert torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))


# -- attention ---------------------------------------------------------------------------------

def _attn_scenario(name, granularity, rotate, seq_lens, q_lens, hq=8, hkv=2, d=64, window=None, seed=0,
                   q_dtype=torch.float32):
    dt = resolve_cache_dtype(name)
    g = torch.Generator().manual_seed(seed)
    bs = 16
    nblk = [(n + bs - 1) // bs for n in seq_lens]
    num_blocks = sum(nblk) + 2
    raw = torch.empty(num_blocks * 2 * bs * hkv * d * dt.itemsize, dtype=torch.uint8)
    raw[0::2], raw[1::2] = {1: (0x7F, 0xFF), 2: (0xFF, 0x7F), 4: (0xFF, 0xFF)}[dt.itemsize]  # stale NaNs
    cache = raw.view(dt.storage).view(num_blocks, 2, bs, hkv, d)
    scale_cache = torch.full((num_blocks, 2, bs, hkv), float("nan"))
    k_scale, v_scale = _scales(name, granularity, hkv, d, g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(nblk) + 1), 9999, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        tables[s, :nblk[s]] = perm[used:used + nblk[s]]
        used += nblk[s]
        pos = torch.arange(n)
        slots = tables[s][pos // bs].long() * bs + pos % bs
        # channel outliers: one hot channel per head, as in real K
        key = torch.randn(n, hkv, d, generator=g)
        key[..., 5] *= 20
        value = torch.randn(n, hkv, d, generator=g)
        write_kv_cache(key, value, cache, slots, dt, k_scale, v_scale, scale_cache, rotate=rotate)
    query = (torch.randn(sum(q_lens), hq, d, generator=g) * 2).to(q_dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(query=query, kv_cache=cache, block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=qsl, dt=dt, k_scale=k_scale, v_scale=v_scale,
                scale_cache=scale_cache if dt.dynamic else None, sm_scale=d ** -0.5,
                sliding_window=window, rotate=rotate)


def _triton(sc):
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in sc.items()}
    return triton_paged_attention(**dev).cpu()


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("name,granularity,rotate", [
    ("fp8_e4m3", "tensor", True), ("fp8_e4m3", "head", True), ("fp8_e4m3", "channel", False),
    ("fp8_e4m3", "channel", True), ("int8", "channel", False), ("int8", "channel", True),
    ("int8", "head", True), ("int8_per_token_head", "tensor", True), ("fp8_per_token_head", "tensor", True),
    ("bfloat16", "tensor", True), ("float32", "tensor", True)])
def test_attention_matches_reference(name, granularity, rotate):
    # prefill over a cached prefix, pure prefill, decodes, and a sequence without queries
    sc = _attn_scenario(name, granularity, rotate, [37, 20, 5, 9], [9, 20, 1, 0], seed=7)
    ref = paged_attention(**sc)
    out = _triton(sc)
    assert bool(torch.isfinite(ref).all()) and bool(torch.isfinite(out).all())
    assert _rel(out, ref) < 1e-3


@pytest.mark.parametrize("window", [None, 6])
def test_attention_channel_rotation_head_dim_256_and_window(window):
    sc = _attn_scenario("int8", "channel", True, [40, 3], [12, 1], hq=4, hkv=1, d=256, window=window, seed=8)
    assert _rel(_triton(sc), paged_attention(**sc)) < 1e-3


def test_attention_bf16_queries_with_rotation():
    sc = _attn_scenario("fp8_e4m3", "channel", True, [30, 7], [10, 1], seed=9, q_dtype=torch.bfloat16)
    assert _rel(_triton(sc), paged_attention(**sc)) < 2e-2


@pytest.mark.parametrize("window", [None, 5])
def test_rotation_without_quantization_is_plain_attention(window):
    """An fp32 cache holding KH, VH gives the same attention as one holding K, V (to 1e-5)."""
    rotated = _attn_scenario("float32", "tensor", True, [33, 18, 4], [7, 18, 1], seed=10, window=window)
    plain = _attn_scenario("float32", "tensor", False, [33, 18, 4], [7, 18, 1], seed=10, window=window)
    assert torch.equal(rotated["query"], plain["query"])
    want = paged_attention(**plain)
    for got in (paged_attention(**rotated), _triton(rotated)):
        assert (got - want).abs().max().item() < 1e-5


def test_rotation_rejects_non_power_of_two_head_dim():
    dt = resolve_cache_dtype("fp8_e4m3")
    key = torch.randn(2, 1, 48)
    cache = torch.zeros(2, 2, 4, 1, 48, dtype=dt.storage)
    s = torch.ones(1)
    for fn in (write_kv_cache, triton_write_kv_cache):
        with pytest.raises(ValueError, match="power-of-two head_dim"):
            fn(key, key, cache, torch.tensor([0, 1]), dt, s, s, rotate=True)


def test_channel_scale_shape_is_checked():
    dt = resolve_cache_dtype("int8")
    key = torch.randn(2, 2, 16)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=dt.storage)
    with pytest.raises(ValueError, match="per-channel k_scale"):
        triton_write_kv_cache(key, key, cache, torch.tensor([0, 1]), dt, torch.ones(2, 8), torch.ones(2, 8))
