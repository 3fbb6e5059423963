"""Triton paged attention vs the torch reference (fp32 queries, 1e-3 relative error).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 must be
set before the kernel module is imported, so it is set here at import time).
Every unused slot and unused block of the cache holds bytes that decode to NaN
(or garbage for int8; tests/support/paged.py), so a kernel that reads past seq_len fails loudly.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402,F401 - a hard dependency (the test and triton extras): a missing one fails
from support.paged import context_slots, paged_scenario  # noqa: E402

from qkv.kernels import reference  # noqa: E402
from qkv.kernels.paged import PagedLayer, StepMetadata  # noqa: E402
from qkv.kernels.quant import STORAGE_DTYPES, resolve_cache_dtype  # noqa: E402
from qkv.kernels.triton_backend import TritonKernels  # noqa: E402

TRITON = TritonKernels()


def _scenario(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, name, **kw):
    return paged_scenario(name, seq_lens, q_lens, hq=num_q_heads, hkv=num_kv_heads, d=head_dim, **kw)


def _check(sc, sliding_window=None, tol=1e-3):
    sc = sc.with_window(sliding_window)
    ref = reference.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    dev = sc.on(DEVICE)
    TRITON.prepare(dev.layer)
    out = TRITON.attend(dev.layer, dev.query, dev.meta, dev.sm_scale).cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert bool(torch.isfinite(ref).all()), "reference read stale bytes"
    assert bool(torch.isfinite(out).all()), "kernel read stale bytes"
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < tol, f"relative error {err:.2e}"


ALL_DTYPES = [n for n in STORAGE_DTYPES if n != "float16"]  # float16 is tested by the split-KV tests


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


@pytest.mark.parametrize("head_dim,name", [(128, "int8_per_token_head"), (256, "fp8_e4m3"), (256, "bfloat16")])
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


@pytest.mark.parametrize(
    "name,stale",
    [
        ("fp8_e4m3", (0x7F, 0x7F)),
        ("fp8_e4m3", (0xFF, 0xFF)),
        ("fp8_per_token_head", (0x7F, 0xFF)),
        ("bfloat16", (0xC0, 0x7F)),
    ],
)
def test_stale_nan_bytes_are_never_read(name, stale):
    sc = _scenario([19, 5, 33], [3, 1, 33], 4, 2, 64, name, stale=stale, seed=10)
    cache, bs = sc.layer.kv, sc.layer.block_size
    # every slot past seq_len in used blocks, and every unused block, decodes to NaN
    owned = torch.zeros(cache.shape[0] * bs, dtype=torch.bool)
    for s, n in enumerate(sc.seq_lens):
        owned[context_slots(sc.tables, s, 0, n, bs)] = True
    flat = cache.transpose(1, 2).reshape(-1, 2 * cache.shape[3] * cache.shape[4]).float()
    assert bool(torch.isnan(flat[~owned]).all()) and bool(torch.isfinite(flat[owned]).all())
    _check(sc)
    _check(sc, sliding_window=4)


def test_bf16_queries():
    sc = _scenario([30, 7], [10, 1], 8, 2, 64, "fp8_e4m3", q_dtype=torch.bfloat16, seed=11)
    _check(sc, tol=2e-2)


def test_layer_and_step_are_validated_once_with_clear_errors():
    """A layer's cache and scales are checked when the layer is built, a step's shapes when its metadata is,
    and the head sizes the kernels cannot run when the back end prepares the layer."""
    sc = _scenario([8], [2], 4, 2, 64, "fp8_e4m3", seed=12)
    layer = sc.layer
    with pytest.raises(ValueError, match="multiple"):
        TRITON.attend(layer, sc.query[:, :3], sc.meta, sc.sm_scale)
    with pytest.raises(ValueError, match="k_scale"):
        PagedLayer(layer.kv, layer.dt, None, layer.v_scale)
    with pytest.raises(ValueError, match="dtype"):
        PagedLayer(layer.kv, resolve_cache_dtype("int8"), layer.k_scale, layer.v_scale)
    with pytest.raises(ValueError, match="head_dim"):
        TRITON.prepare(PagedLayer(layer.kv[..., :48], layer.dt, layer.k_scale, layer.v_scale))
    with pytest.raises(ValueError, match="scale_cache"):
        PagedLayer(layer.kv, resolve_cache_dtype("fp8_per_token_head"))
    with pytest.raises(ValueError, match="slot_mapping has 3 entries for 2 query tokens"):
        StepMetadata.build([0, 1, 2], sc.tables, [8], [0, 2])
    with pytest.raises(ValueError, match="query_start_loc"):
        StepMetadata.build([0, 1], sc.tables, [8], [0, 1, 2])


def test_write_then_attend_with_both_triton_kernels():
    """Triton write + Triton attention == reference write + reference attention."""
    sc = _scenario([21, 6], [21, 6], 6, 3, 64, "int8_per_token_head", seed=13)
    g = torch.Generator().manual_seed(14)
    key, value = torch.randn(2, 27, 3, 64, generator=g)
    dev = sc.on(DEVICE)
    reference.write(sc.layer, key, value, sc.meta)
    TRITON.write(dev.layer, key.to(DEVICE), value.to(DEVICE), dev.meta)
    ref = reference.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    out = TRITON.attend(dev.layer, dev.query, dev.meta, dev.sm_scale).cpu()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-3
