"""Triton cache-write kernel vs the torch reference: the cache bytes must be identical.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 must be
set before the kernel module is imported, so it is set here at import time).
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402,F401 - a hard dependency (the test and triton extras): a missing one fails
from support.paged import write_step  # noqa: E402

from qkv.kernels import reference  # noqa: E402
from qkv.kernels.paged import PagedLayer  # noqa: E402
from qkv.kernels.quant import resolve_cache_dtype  # noqa: E402
from qkv.kernels.triton_cache_write import triton_write  # noqa: E402

SENTINEL = 0x5A
NUM_BLOCKS, BLOCK_SIZE = 6, 4


def _grid(storage: torch.dtype) -> torch.Tensor:
    """All finite non-negative values of an fp8 format, sorted."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(storage).float()
    v = v[torch.isfinite(v) & (v >= 0)]
    return v.unique().sort().values


def _special_values(dt) -> torch.Tensor:
    """Values (in units of x / s) that stress saturation, ties and subnormals."""
    qmax = dt.qmax
    extra = [
        0.0,
        -0.0,
        qmax,
        -qmax,
        qmax * 1.0001,
        qmax + 16,
        464.0,
        465.0,
        500.0,
        -500.0,
        1000.0,
        -1000.0,
        1e6,
        -1e6,
        1.98,
        -1.98,
        1.97,
        0.999,
        3.99,
        15.9,
        1e-30,
        -1e-30,
    ]
    if dt.kind == "int":
        ties = torch.arange(-130, 130, dtype=torch.float32) + 0.5
        extra += [126.4, 126.6, 127.4, 127.6, -127.6, 128.0, -128.0, 0.49, 0.51, -0.5, -1.5]
        return torch.cat([ties, torch.tensor(extra)])
    grid = _grid(dt.storage)
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbours, subnormals included
    nudged = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    min_sub = float(grid[1])  # 2**-9 (e4m3) or 2**-16 (e5m2)
    extra += [min_sub, min_sub / 2, min_sub * 1.5, min_sub * 2.5, min_sub / 4, -min_sub / 2, -min_sub * 0.75]
    return torch.cat([mids, -mids, nudged, grid, -grid, torch.tensor(extra)])


def _inputs(dt, num_tokens, num_heads, head_dim, scales, seed=0):
    """[T, H, D] keys/values whose x / scale covers the special values, then random ones."""
    g = torch.Generator().manual_seed(seed)
    n = num_tokens * num_heads * head_dim
    special = _special_values(dt)
    rand = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 10, (n,), generator=g).float())
    out = []
    for shift in (0, len(special) // 3):
        q = torch.cat([special.roll(shift), rand])[:n]
        q = q[torch.randperm(n, generator=g)] if shift else q
        out.append(q.view(num_tokens, num_heads, head_dim) * scales.view(1, -1, 1))
    return out


def _empty_cache(dt, num_heads, head_dim):
    nbytes = NUM_BLOCKS * 2 * BLOCK_SIZE * num_heads * head_dim * dt.itemsize
    raw = torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
    cache = raw.view(dt.storage).view(NUM_BLOCKS, 2, BLOCK_SIZE, num_heads, head_dim)
    scale_cache = torch.full((NUM_BLOCKS, 2, BLOCK_SIZE, num_heads), -3.25)
    return cache, scale_cache


def _slots(num_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[1] = -1
    slots[-2] = -1
    return slots


def _run_both(dt, key, value, k_scale, v_scale, slots, num_heads, head_dim):
    """The reference's write on the CPU and the Triton kernel's on DEVICE, each into a fresh sentinel cache."""
    results = []
    for fn, dev in ((reference.write, "cpu"), (triton_write, DEVICE)):
        cache, scale_cache = (t.to(dev) for t in _empty_cache(dt, num_heads, head_dim))

        def mv(t, dev=dev):
            return None if t is None else t.to(dev)

        layer = PagedLayer(cache, dt, mv(k_scale), mv(v_scale), scale_cache if dt.dynamic else None)
        fn(layer, key.to(dev), value.to(dev), write_step(slots, dev))
        results.append((layer.kv.cpu(), scale_cache.cpu()))
    return results


def _assert_same_bytes(ref, tri, slots, dt, num_heads):
    (ref_cache, ref_sc), (tri_cache, tri_sc) = ref, tri
    assert torch.equal(ref_cache.view(torch.uint8), tri_cache.view(torch.uint8))
    if dt.dynamic:
        assert torch.equal(ref_sc.view(torch.int32), tri_sc.view(torch.int32))
    # slots never written (slot -1 and unused slots) still hold the sentinel bytes
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = tri_cache.view(torch.uint8).view(NUM_BLOCKS, 2, BLOCK_SIZE, -1).transpose(1, 2)
    untouched = untouched.reshape(NUM_BLOCKS * BLOCK_SIZE, -1)[~written]
    assert bool((untouched == SENTINEL).all())
    if dt.dynamic:
        sc = tri_sc.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, 2, num_heads)
        assert bool((sc[~written] == -3.25).all())


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("num_heads", [3, 5])
def test_static_scales_bytes_identical(name, granularity, num_heads):
    dt = resolve_cache_dtype(name)
    head_dim, num_tokens = 32, 12
    if granularity == "tensor":
        k_scale, v_scale = torch.full((num_heads,), 1.0), torch.full((num_heads,), 0.037)
    else:  # powers of two keep ties exact; the others make x / s inexact
        k_scale = torch.tensor([1.0, 0.5, 2.0, 0.37, 3.1][:num_heads])
        v_scale = torch.tensor([0.25, 0.013, 4.0, 1.0, 7.7][:num_heads])
    key, _ = _inputs(dt, num_tokens, num_heads, head_dim, k_scale, seed=1)
    _, value = _inputs(dt, num_tokens, num_heads, head_dim, v_scale, seed=2)
    slots = _slots(num_tokens)
    ref, tri = _run_both(dt, key, value, k_scale, v_scale, slots, num_heads, head_dim)
    _assert_same_bytes(ref, tri, slots, dt, num_heads)


@pytest.mark.parametrize("name", ["fp8_per_token_head", "int8_per_token_head"])
@pytest.mark.parametrize("num_heads", [3, 5])
def test_dynamic_scales_bytes_identical(name, num_heads):
    dt = resolve_cache_dtype(name)
    head_dim, num_tokens = 40, 14  # head_dim not a power of two on purpose
    g = torch.Generator().manual_seed(3)
    special = _special_values(dt).clamp(-dt.qmax, dt.qmax)
    rows = []
    for i in range(num_tokens * num_heads * 2):
        kind = i % 5
        if kind == 0:  # amax = qmax * 2**k: power-of-two scale keeps every tie exact
            k = int(torch.randint(-6, 6, (1,), generator=g))
            r = special[torch.randint(len(special), (head_dim,), generator=g)]
            r[0] = dt.qmax
            rows.append(r * 2.0**k)
        elif kind == 1:
            rows.append(torch.zeros(head_dim))  # scale floors at 1e-8
        elif kind == 2:
            rows.append(torch.randn(head_dim, generator=g) * 1e-12)  # below the floor
        else:
            rows.append(torch.randn(head_dim, generator=g) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g)))
    x = torch.stack(rows).view(2, num_tokens, num_heads, head_dim)
    slots = _slots(num_tokens, seed=4)
    ref, tri = _run_both(dt, x[0], x[1], None, None, slots, num_heads, head_dim)
    _assert_same_bytes(ref, tri, slots, dt, num_heads)


@pytest.mark.parametrize(
    "name,in_dtype",
    [("bfloat16", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float32)],
)
def test_unquantized_copy_bytes_identical(name, in_dtype):
    dt = resolve_cache_dtype(name)
    num_heads, head_dim, num_tokens = 3, 32, 10
    g = torch.Generator().manual_seed(5)
    key = (torch.randn(num_tokens, num_heads, head_dim, generator=g) * 100).to(in_dtype)
    value = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(in_dtype)
    if in_dtype == torch.float32:  # exact bf16 ties: 1 + 2**-8 + k * 2**-7 sits halfway
        key.view(-1)[:64] = 1 + 2**-8 + torch.arange(64) * 2**-7
    slots = _slots(num_tokens, seed=6)
    ref, tri = _run_both(dt, key, value, None, None, slots, num_heads, head_dim)
    _assert_same_bytes(ref, tri, slots, dt, num_heads)


def test_bf16_inputs_fp8_cache():
    dt = resolve_cache_dtype("fp8_e4m3")
    scales = torch.tensor([0.02, 1.0, 0.5])
    key, value = _inputs(dt, 8, 3, 32, scales, seed=7)
    key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    slots = _slots(8, seed=8)
    ref, tri = _run_both(dt, key, value, scales, scales, slots, 3, 32)
    _assert_same_bytes(ref, tri, slots, dt, 3)


def test_reference_known_bytes():
    """Hand-checked values: saturation, carries into the exponent, ties to even."""

    def write(name, values, scale=1.0):
        dt = resolve_cache_dtype(name)
        x = torch.tensor(values, dtype=torch.float32).view(1, 1, -1)
        s = torch.tensor([scale])
        layer = PagedLayer(torch.zeros(1, 2, 1, 1, x.shape[-1], dtype=dt.storage), dt, s, s)
        reference.write(layer, x, x, write_step([0]))
        return layer.kv[0, 0, 0, 0]

    e4m3 = write("fp8_e4m3", [1.98, 500.0, 464.0, 448.0, -1000.0, 1.0625, 1.1875, 2**-10, 3 * 2**-10, 0.0])
    assert e4m3.view(torch.uint8).tolist() == [0x40, 0x7E, 0x7E, 0x7E, 0xFE, 0x38, 0x3A, 0x00, 0x02, 0x00]
    assert e4m3.float().tolist() == [2.0, 448.0, 448.0, 448.0, -448.0, 1.0, 1.25, 0.0, 2**-8, 0.0]
    e5m2 = write("fp8_e5m2", [1e6, -1e6, 1.125, 1.375])
    assert e5m2.float().tolist() == [57344.0, -57344.0, 1.0, 1.5]
    i8 = write("int8", [2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 127.6, -1000.0])
    assert i8.tolist() == [2, 4, -2, 0, 0, 2, 127, -127]
    assert write("int8", [5.0, -5.0], scale=2.0).tolist() == [2, -2]  # 2.5 -> 2, ties to even


def _one_slot_layer(dt, n, device):
    """A one-slot, one-head fp8 cache of ``n`` channels with unit scales."""
    one = torch.ones(1, device=device)
    return PagedLayer(torch.zeros(1, 2, 1, 1, n, dtype=dt.storage, device=device), dt, one, one)


def test_same_results_through_triton_for_known_bytes():
    dt = resolve_cache_dtype("fp8_e4m3")
    x = torch.tensor([1.98, 500.0, 464.0, -464.0, 2**-10, -(2**-10)]).view(1, 1, -1).to(DEVICE)
    layer = _one_slot_layer(dt, 6, DEVICE)
    triton_write(layer, x, x, write_step([0], DEVICE))
    assert layer.kv[0, 0, 0, 0].view(torch.uint8).tolist() == [0x40, 0x7E, 0x7E, 0xFE, 0x00, 0x80]


def test_nan_input_stays_nan():
    dt = resolve_cache_dtype("fp8_e4m3")
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1.0]).view(1, 1, -1).to(DEVICE)
    layer = _one_slot_layer(dt, 5, DEVICE)
    triton_write(layer, x, x, write_step([0], DEVICE))
    ref = _one_slot_layer(dt, 5, "cpu")
    reference.write(ref, x.cpu(), x.cpu(), write_step([0]))
    assert torch.equal(layer.kv.cpu().view(torch.uint8), ref.kv.view(torch.uint8))
    assert layer.kv[0, 0, 0, 0].view(torch.uint8).tolist() == [0x7F, 0xFF, 0x7E, 0xFE, 0x38]


def test_launcher_validates_inputs():
    """The layer's checks run when it is built, the step's against the layer when the kernel is launched."""
    dt = resolve_cache_dtype("fp8_e4m3")
    key = torch.zeros(2, 3, 16, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 3, 16, dtype=dt.storage, device=DEVICE)
    meta = write_step([0, 1], DEVICE)
    s = torch.ones(3, device=DEVICE)
    layer = PagedLayer(cache, dt, s, s)
    with pytest.raises(ValueError, match="k_scale"):
        PagedLayer(cache, dt)
    with pytest.raises(ValueError, match="dtype"):
        PagedLayer(cache.view(torch.int8), dt, s, s)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_write(layer, key, key, write_step([0], DEVICE))
    # a cache of another head count: the layer is fine, the step's K/V do not fit it
    with pytest.raises(ValueError, match=r"key and value must both be \[T, Hkv, D\]"):
        triton_write(PagedLayer(cache[:, :, :, :2], dt, s[:2], s[:2]), key, key, meta)
    with pytest.raises(ValueError, match="kv_cache must be"):
        PagedLayer(cache[:, 0], dt, s, s)
    with pytest.raises(ValueError, match="num_kv_heads"):
        PagedLayer(cache, dt, torch.ones(2, device=DEVICE), s)
    with pytest.raises(ValueError, match="scale_cache"):
        PagedLayer(cache, resolve_cache_dtype("fp8_per_token_head"))
