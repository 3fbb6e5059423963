"""The 4-bit per-token caches (``int4_per_token_head``, ``k8v4_per_token_head``): codes, packing, layout, and
every back end's cache bytes against the reference.

The kernel-vs-reference attention tests of each back end run these dtypes too (they iterate every storage
dtype); here are the facts specific to 4 bits: exact codes and bytes, the half-row plane layout, clipping,
and the capacity they buy.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from support.paged import bits, paged_scenario, write_step  # noqa: E402

from qkv.kernels import reference  # noqa: E402
from qkv.kernels.cpu_attention import CpuKernels  # noqa: E402
from qkv.kernels.paged import PagedLayer  # noqa: E402
from qkv.kernels.quant import (  # noqa: E402
    PACKED_CACHE_DTYPES,
    dynamic_scales,
    pack_int4,
    quantize,
    resolve_cache_dtype,
    unpack_int4,
)
from qkv.kernels.triton_attention import triton_attend  # noqa: E402
from qkv.kernels.triton_cache_write import triton_write  # noqa: E402
from qkv.kv_cache import KVCache, LayerSpec  # noqa: E402
from qkv.registry import default_cache_dir  # noqa: E402

INT4, K8V4 = resolve_cache_dtype("int4_per_token_head"), resolve_cache_dtype("k8v4_per_token_head")
SENTINEL = 0x5A


@pytest.fixture(scope="module")
def cpu() -> CpuKernels:
    return CpuKernels.build(default_cache_dir() / "kernels")


def test_the_two_modes_are_the_packed_ones():
    assert PACKED_CACHE_DTYPES == ("int4_per_token_head", "k8v4_per_token_head")
    assert (INT4.planes, K8V4.planes) == (2, 3)
    assert (list(INT4.side_planes(0)), list(INT4.side_planes(1))) == ([0], [1])
    assert (list(K8V4.side_planes(0)), list(K8V4.side_planes(1))) == ([0, 1], [2])
    assert (INT4.side_qmax(0), INT4.side_qmax(1), K8V4.side_qmax(0), K8V4.side_qmax(1)) == (8.0, 8.0, 127.0, 8.0)
    assert (INT4.side_codes(0), K8V4.side_codes(0), K8V4.side_codes(1)) == ((-8.0, 7.0), (-127.0, 127.0), (-8.0, 7.0))
    assert INT4.cache_shape(5, 16, 3, 64) == (5, 2, 16, 3, 32)
    assert K8V4.cache_shape(5, 16, 3, 64) == (5, 3, 16, 3, 32)


def test_pack_puts_channel_j_low_and_j_plus_half_high():
    q = torch.tensor([[-8, -1, 0, 7, 1, 2, -7, 3]], dtype=torch.int8)  # D = 8: bytes pair channel j with j + 4
    packed = pack_int4(q)
    assert packed.tolist() == [[0x18, 0x2F, 0x90, 0x37]]
    assert torch.equal(unpack_int4(packed), q)
    every = torch.arange(-8, 8, dtype=torch.int8).repeat_interleave(16).view(16, 16)  # all 256 nibble pairs
    every = torch.cat([every, every.t()], dim=1)
    assert torch.equal(unpack_int4(pack_int4(every)), every)
    assert sorted(set(pack_int4(every).flatten().tolist())) == list(range(256))


def test_int4_codes_round_half_to_even_and_saturate_on_the_signed_grid():
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, -2.5, 6.6, 7.4, 100.0, -100.0, float("nan"), 3.49, -3.51]]])
    q = quantize(x, torch.ones(1, 1), INT4, kv=1)
    assert q.tolist() == [[[0, 2, 2, 0, -2, 7, 7, 7, -8, 0, 3, -4]]]
    # a negative scale mirrors the codes: 100 takes -8, -100 saturates at 7
    assert quantize(x, -torch.ones(1, 1), INT4, kv=1).tolist() == [[[0, -2, -2, 0, 2, -7, -7, -8, 7, 0, -3, 4]]]
    # k8v4: the same values as K are int8 codes
    assert quantize(x, torch.ones(1, 1), K8V4, kv=0).tolist() == [[[0, 2, 2, 0, -2, 7, 7, 100, -100, 0, 3, -4]]]


def test_clipping_scales_the_absmax_rule_and_the_extremes_sign_picks_the_scales():
    x = torch.tensor([[[1.0, -16.0, 4.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]], [[-2.0, 16.0, 0.5, 3.0]]])
    floor = torch.tensor(1e-8).item()
    # the negative extreme keeps a positive scale; a positive one (and a zero row) flips it, onto code -8
    assert dynamic_scales(x, INT4).flatten().tolist() == [2.0, -floor, -2.0]
    assert quantize(x, dynamic_scales(x, INT4), INT4).tolist() == [[[0, -8, 2, 0]], [[0, 0, 0, 0]], [[1, -8, 0, -2]]]
    clipped = dynamic_scales(x, INT4, kv=1, clip=0.5)
    assert clipped.flatten().tolist() == [1.0, -floor, -1.0]
    # with the clipped scale, -16 saturates at -8 and 16 at -8; 0.5 rounds to 0 (half to even)
    assert quantize(x, clipped, INT4).tolist() == [[[1, -8, 4, 0]], [[0, 0, 0, 0]], [[2, -8, 0, -3]]]
    # k8v4's K is int8: symmetric, the scale's sign never flips
    k_scale = (torch.tensor(16.0) / 127).item()
    assert dynamic_scales(x, K8V4, kv=0).flatten().tolist() == [k_scale, floor, k_scale]


def test_reference_write_lays_k8v4_out_in_three_half_row_planes():
    layer = PagedLayer(
        torch.zeros(K8V4.cache_shape(2, 4, 1, 8), dtype=torch.uint8), K8V4, scale_cache=torch.zeros(2, 2, 4, 1)
    )
    key = torch.tensor([[[127.0, -1, 2, -3, 4, -5, 6, -127]]])  # amax 127: scale 1, codes = values
    value = torch.tensor([[[-8.0, 1, -1, 0, 7, 2, 3, 6]]])  # amax 8 at a negative value: scale 1
    reference.write(layer, key, value, write_step([6]))  # block 1, offset 2
    row = layer.kv[1, :, 2, 0]
    assert row[0].view(torch.int8).tolist() == [127, -1, 2, -3]  # K channels 0..3
    assert row[1].view(torch.int8).tolist() == [4, -5, 6, -127]  # K channels 4..7
    assert row[2].tolist() == [0x78, 0x21, 0x3F, 0x60]  # V: channel j | channel j + 4 << 4
    assert layer.scale_cache[1, :, 2, 0].tolist() == [1.0, 1.0]
    assert int(layer.kv[0].count_nonzero()) == 0 and int(layer.kv[1, :, :2].count_nonzero()) == 0
    k, v = reference.gather_kv(layer, torch.tensor([0, 1]), 7, torch.float32, start=6)
    assert k.flatten().tolist() == key.flatten().tolist() and v.flatten().tolist() == value.flatten().tolist()


def _inputs(num_tokens: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of every magnitude, zero rows, exact ties of the scaled grid and one huge outlier per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, num_tokens, heads, dim, generator=g) * torch.exp2(
        torch.randint(-8, 8, (2, num_tokens, heads, 1), generator=g).float()
    )
    x[:, 3] = 0.0
    x[:, 5] = 0.0
    x[:, 5, :, :4] = torch.tensor([-8.0, 0.5, 1.5, -2.5])  # int4 scale 1 (unclipped): ties 0.5, 1.5, -2.5
    x[:, 4] = 0.0
    x[:, 4, :, :4] = torch.tensor([8.0, -0.5, 1.5, -2.5])  # int4 scale -1: ties again, the extreme on -8
    x[:, 6, :, 0] = 1e4
    return x[0], x[1]


def _layer(dt, heads: int, dim: int, clips=(1.0, 1.0), rotate=False, device="cpu") -> PagedLayer:
    raw = torch.full(dt.cache_shape(6, 4, heads, dim), SENTINEL, dtype=torch.uint8, device=device)
    sc = torch.full((6, 2, 4, heads), -3.25, device=device)
    return PagedLayer(raw, dt, None, None, sc, rotate, None, *clips)


@pytest.mark.parametrize("name", PACKED_CACHE_DTYPES)
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("clips", [(1.0, 1.0), (0.85, 0.925)])
def test_every_back_end_writes_the_references_bytes(cpu, name, rotate, clips):
    dt = resolve_cache_dtype(name)
    heads, dim = 3, 32
    key, value = _inputs(14, heads, dim, seed=1)
    slots = torch.randperm(24, generator=torch.Generator().manual_seed(2))[:14]
    slots[1] = -1
    written = []
    for write, device in ((reference.write, "cpu"), (cpu.write, "cpu"), (triton_write, DEVICE)):
        layer = _layer(dt, heads, dim, clips, rotate, device)
        write(layer, key.to(device), value.to(device), write_step(slots, device))
        written.append((layer.kv.cpu(), layer.scale_cache.cpu()))
    (ref_kv, ref_sc), *others = written
    for kv, sc in others:
        assert torch.equal(kv, ref_kv) and torch.equal(bits(sc), bits(ref_sc))
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    per_slot = ref_kv.transpose(1, 2).reshape(24, -1)
    assert bool((per_slot[untouched] == SENTINEL).all()) and bool((per_slot[~untouched] != SENTINEL).any())


@pytest.mark.parametrize("name", PACKED_CACHE_DTYPES)
@pytest.mark.parametrize("rotate", [False, True])
def test_attention_over_packed_blocks_matches_the_reference(cpu, name, rotate):
    """A mixed step (decodes, a prefill over a cached prefix, a long prefill) and a long split-KV decode, 64-wide
    heads (the models' size), on the fused CPU kernel and the Triton kernel."""
    steps = (([1, 5, 40, 1, 33], [50, 5, 60, 17, 70]), ([1, 1, 1], [300, 700, 20]))
    for q_lens, seq_lens in steps:
        sc = paged_scenario(name, seq_lens, q_lens, hq=6, hkv=2, d=64, rotate=rotate, granularity=None)
        want = reference.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
        got_cpu = cpu.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
        moved = sc.on(DEVICE)
        got_triton = triton_attend(moved.layer, moved.query, moved.meta, sc.sm_scale, num_sms=132).cpu()
        for got in (got_cpu, got_triton):
            assert bool(torch.isfinite(got).all())
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_capacity_counts_the_packed_values_and_the_scales():
    """SmolLM2-135M's layers (3 kv heads of 64): 768 B/token/layer in bf16, 216 in int4 (96 + 96 + 24 of fp32
    scales), 312 in k8v4 (192 + 96 + 24)."""
    spec = {n: LayerSpec(0, 3, 64, resolve_cache_dtype(n)) for n in ("bfloat16", *PACKED_CACHE_DTYPES)}
    assert {n: s.bytes_per_token for n, s in spec.items()} == {
        "bfloat16": 768,
        "int4_per_token_head": 216,
        "k8v4_per_token_head": 312,
    }
    cache = KVCache([spec["int4_per_token_head"]] * 2, num_blocks=10, block_size=16)
    assert cache.num_bytes == 2 * 10 * 16 * 216
    assert tuple(cache.layers[0].kv.shape) == (10, 2, 16, 3, 32) and cache.layers[0].head_dim == 64


def test_bad_layouts_and_clips_name_the_problem():
    with pytest.raises(
        ValueError, match=r"int4_per_token_head kv_cache must be \[num_blocks, 2, block_size, Hkv, D / 2\]"
    ):
        PagedLayer(torch.zeros(2, 3, 4, 1, 8, dtype=torch.uint8), INT4, scale_cache=torch.zeros(2, 2, 4, 1))
    with pytest.raises(ValueError, match="k_clip must be in"):
        PagedLayer(torch.zeros(2, 2, 4, 1, 8, dtype=torch.uint8), INT4, scale_cache=torch.zeros(2, 2, 4, 1), k_clip=1.5)
    with pytest.raises(ValueError, match="v_clip must be in"):
        PagedLayer(torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16), resolve_cache_dtype("bfloat16"), v_clip=0.9)
