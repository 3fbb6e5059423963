"""Triton paged attention vs the torch reference (fp32 queries, 1e-3 relative error).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 must be
set before the kernel module is imported, so it is set here at import time).
Every unused slot and unused block of the cache is filled with bytes that decode
to NaN (or garbage for int8), so a kernel that reads past seq_len fails loudly.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402,F401 - a hard dependency (the test and triton extras): a missing one fails

from qkv.kernels.quant import resolve_cache_dtype  # noqa: E402
from qkv.kernels.reference import paged_attention, write_kv_cache  # noqa: E402
from qkv.kernels.triton_attention import triton_paged_attention  # noqa: E402

STALE_BYTES = {1: (0x7F, 0xFF), 2: (0xFF, 0x7F), 4: (0xFF, 0xFF)}  # NaN in fp8/bf16/fp32; -1 garbage in int8


def _scenario(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, name, block_size=16,
              q_dtype=torch.float32, stale=None, seed=0):
    """Build a shuffled paged cache holding each sequence's context, plus queries."""
    dt = resolve_cache_dtype(name)
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    nbytes = num_blocks * 2 * block_size * num_kv_heads * head_dim * dt.itemsize
    raw = torch.empty(nbytes, dtype=torch.uint8)
    raw[0::2], raw[1::2] = stale or STALE_BYTES[dt.itemsize]  # stale bytes everywhere
    cache = raw.view(dt.storage).view(num_blocks, 2, block_size, num_kv_heads, head_dim)
    scale_cache = torch.full((num_blocks, 2, block_size, num_kv_heads), float("nan"))
    k_scale = torch.rand(num_kv_heads, generator=g) * 0.02 + 0.01 if dt.quantized else None
    v_scale = torch.rand(num_kv_heads, generator=g) * 0.02 + 0.01 if dt.quantized else None
    if dt.kind == "int":
        k_scale, v_scale = k_scale * 2, v_scale * 2

    perm = torch.randperm(num_blocks, generator=g)  # non-contiguous, shuffled block tables
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), 10_000, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        block_tables[s, :blocks_per_seq[s]] = perm[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        pos = torch.arange(n)
        slots = block_tables[s][pos // block_size].long() * block_size + pos % block_size
        key = torch.randn(n, num_kv_heads, head_dim, generator=g)
        value = torch.randn(n, num_kv_heads, head_dim, generator=g)
        write_kv_cache(key, value, cache, slots, dt, k_scale, v_scale, scale_cache)
    query = (torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g) * 2).to(q_dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(query=query, kv_cache=cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=query_start_loc,
                dt=dt, k_scale=k_scale, v_scale=v_scale,
                scale_cache=scale_cache if dt.dynamic else None, sm_scale=head_dim ** -0.5)


def _check(sc, sliding_window=None, tol=1e-3):
    ref = paged_attention(**sc, sliding_window=sliding_window)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in sc.items()}
    out = triton_paged_attention(**dev, sliding_window=sliding_window).cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert bool(torch.isfinite(ref).all()), "reference read stale bytes"
    assert bool(torch.isfinite(out).all()), "kernel read stale bytes"
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < tol, f"relative error {err:.2e}"


ALL_DTYPES = ["bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "int8", "fp8_per_token_head", "int8_per_token_head"]


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_mixed_batch_every_cache_dtype(name):
    # prefix + new tokens, pure prefill, decodes, and a sequence with no query this step
    sc = _scenario([37, 20, 5, 9, 30], [9, 20, 1, 0, 1], 8, 2, 64, name, seed=1)
    _check(sc)


def test_prefill_over_cached_prefix():
    _check(_scenario([45, 70], [13, 30], 4, 4, 64, "fp8_e4m3", seed=2))


def test_pure_prefill():
    _check(_scenario([33, 16, 1], [33, 16, 1], 6, 2, 64, "int8", seed=3))


def test_decode_several_sequences():
    _check(_scenario([1, 17, 40, 64, 23], [1] * 5, 8, 1, 64, "fp8_per_token_head", seed=4))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 2), (12, 3), (8, 1), (5, 5)])
def test_gqa_ratios(num_q_heads, num_kv_heads):
    _check(_scenario([26, 9], [6, 1], num_q_heads, num_kv_heads, 64, "fp8_e4m3", seed=5))


@pytest.mark.parametrize("head_dim,name", [(128, "int8_per_token_head"), (256, "fp8_e4m3"),
                                           (256, "bfloat16")])
def test_head_dims(head_dim, name):
    _check(_scenario([21, 35], [5, 1], 4, 2, head_dim, name, seed=6))


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("name", ["fp8_e4m3", "int8_per_token_head"])
def test_sliding_window(window, name):
    # windows smaller than the context, in prefill, prefix + new tokens, and decode
    sc = _scenario([40, 25, 50], [25, 25, 1], 4, 2, 64, name, seed=7)
    _check(sc, sliding_window=window)


def test_sliding_window_larger_than_context():
    _check(_scenario([12, 30], [12, 3], 4, 2, 64, "fp8_e4m3", seed=8), sliding_window=64)


@pytest.mark.parametrize("block_size", [4, 12, 64])
def test_block_sizes(block_size):
    # blocks smaller than, not a power of two, and larger than the kernel's key tile
    _check(_scenario([29, 70], [7, 1], 4, 2, 64, "fp8_e5m2", block_size=block_size, seed=9))


@pytest.mark.parametrize("name,stale", [("fp8_e4m3", (0x7F, 0x7F)), ("fp8_e4m3", (0xFF, 0xFF)),
                                        ("fp8_per_token_head", (0x7F, 0xFF)), ("bfloat16", (0xC0, 0x7F))])
def test_stale_nan_bytes_are_never_read(name, stale):
    sc = _scenario([19, 5, 33], [3, 1, 33], 4, 2, 64, name, stale=stale, seed=10)
    cache = sc["kv_cache"]
    # every slot past seq_len in used blocks, and every unused block, decodes to NaN
    owned = torch.zeros(cache.shape[0] * cache.shape[2], dtype=torch.bool)
    for s, n in enumerate(sc["seq_lens"].tolist()):
        pos = torch.arange(n)
        owned[sc["block_tables"][s][pos // cache.shape[2]].long() * cache.shape[2] + pos % cache.shape[2]] = True
    flat = cache.transpose(1, 2).reshape(-1, 2 * cache.shape[3] * cache.shape[4]).float()
    assert bool(torch.isnan(flat[~owned]).all()) and bool(torch.isfinite(flat[owned]).all())
    _check(sc)
    _check(sc, sliding_window=4)


def test_bf16_queries():
    sc = _scenario([30, 7], [10, 1], 8, 2, 64, "fp8_e4m3", q_dtype=torch.bfloat16, seed=11)
    _check(sc, tol=2e-2)


def test_launcher_validates_inputs():
    sc = _scenario([8], [2], 4, 2, 64, "fp8_e4m3", seed=12)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in sc.items()}
    with pytest.raises(ValueError, match="multiple"):
        triton_paged_attention(**{**dev, "query": dev["query"][:, :3]})
    with pytest.raises(ValueError, match="k_scale"):
        triton_paged_attention(**{**dev, "k_scale": None})
    with pytest.raises(ValueError, match="dtype"):
        triton_paged_attention(**{**dev, "dt": resolve_cache_dtype("int8")})
    with pytest.raises(ValueError, match="head_dim"):
        q = dev["query"][..., :48]
        triton_paged_attention(**{**dev, "query": q, "kv_cache": dev["kv_cache"][..., :48]})
    with pytest.raises(ValueError, match="scale_cache"):
        triton_paged_attention(**{**dev, "dt": resolve_cache_dtype("fp8_per_token_head")})


def test_write_then_attend_with_both_triton_kernels():
    """Triton write + Triton attention == reference write + reference attention."""
    from qkv.kernels.triton_cache_write import triton_write_kv_cache

    sc = _scenario([21, 6], [21, 6], 6, 3, 64, "int8_per_token_head", seed=13)
    g = torch.Generator().manual_seed(14)
    key, value = torch.randn(2, 27, 3, 64, generator=g)
    cache, scale_cache, bt, bs = sc["kv_cache"], sc["scale_cache"], sc["block_tables"], sc["kv_cache"].shape[2]
    slots = torch.cat([bt[s][torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for s, n in enumerate([21, 6])])
    dev_cache, dev_scales = cache.clone().to(DEVICE), scale_cache.clone().to(DEVICE)
    write_kv_cache(key, value, cache, slots, sc["dt"], None, None, scale_cache)
    triton_write_kv_cache(key.to(DEVICE), value.to(DEVICE), dev_cache, slots.to(DEVICE), sc["dt"], None, None,
                          dev_scales)
    ref = paged_attention(**sc)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in sc.items()}
    out = triton_paged_attention(**{**dev, "kv_cache": dev_cache, "scale_cache": dev_scales}).cpu()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-3
