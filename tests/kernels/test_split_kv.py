"""Split-KV decode: the segment heuristic, the launch grid, and merged outputs vs the unsplit reference.

Without a GPU the kernels run in Triton's interpreter. Contexts are long enough to make
several segments; head_dim is small where the interpreter would otherwise be slow.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402,F401 - a hard dependency (the test and triton extras): a missing one fails
from support.paged import paged_scenario  # noqa: E402

from qkv.kernels import reference  # noqa: E402
from qkv.kernels.launch import capture, emulate_arch  # noqa: E402
from qkv.kernels.paged import PagedLayer, StepMetadata  # noqa: E402
from qkv.kernels.quant import STORAGE_DTYPES, resolve_cache_dtype  # noqa: E402
from qkv.kernels.triton_attention import triton_attend  # noqa: E402
from qkv.kernels.triton_split_kv import num_kv_segments  # noqa: E402

ALL_DTYPES = list(STORAGE_DTYPES)


@pytest.mark.parametrize(
    "seqs,kv_heads,context,want",
    [
        (1, 8, 32768, 17),  # 8 programs -> 17 segments -> 136 programs on 132 SMs
        (1, 8, 8192, 17),
        (1, 8, 1024, 4),  # never shorter than 256 keys per segment
        (1, 8, 300, 1),
        (16, 8, 32768, 2),  # 128 programs -> 2 segments
        (17, 8, 32768, 1),  # 136 programs already fill 132 SMs
        (64, 8, 32768, 1),
        (1, 1, 1 << 20, 64),  # capped
        (2, 2, 1100, 4),
    ],
)
def test_segment_heuristic(seqs, kv_heads, context, want):
    assert num_kv_segments(seqs, kv_heads, context, num_sms=132) == want


def _decode_scenario(name, seq_lens, hq, hkv, d, granularity="head", rotate=False, seed=0, q_lens=None, window=None):
    """A shuffled paged cache (stale NaN bytes elsewhere, a hot K channel) and, by default, one query token per
    sequence."""
    return paged_scenario(
        name,
        seq_lens,
        q_lens or [1] * len(seq_lens),
        hq=hq,
        hkv=hkv,
        d=d,
        granularity=granularity,
        rotate=rotate,
        window=window,
        seed=seed,
        hot_channel=True,
    )


def _run(sc, **kw):
    """Triton output and its recorded launches (the kernels run), split for an H200's 132 SMs on any device."""
    kw.setdefault("num_sms", 132)
    dev = sc.on(DEVICE)
    with capture(execute=True) as launches:
        out = triton_attend(dev.layer, dev.query, dev.meta, dev.sm_scale, **kw).cpu()
    return out, launches


def _reference(sc):
    """The unsplit reference."""
    return reference.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_split_decode_matches_reference_every_cache_dtype(name):
    # uneven lengths: the short sequence leaves most of its segments empty
    sc = _decode_scenario(name, [1100, 300, 5], hq=4, hkv=2, d=32, seed=1)
    out, launches = _run(sc)
    attn, merge = launches
    assert attn.grid == (3, 2, 4) and attn.kwargs["SPLIT"]  # 4 segments: 1100 // 256
    assert merge.name == "_merge_segments_kernel" and merge.grid == (3, 2)
    ref = _reference(sc)
    assert bool(torch.isfinite(out).all())
    assert _rel(out, ref) < (1e-5 if name == "float32" else 1e-3)


@pytest.mark.parametrize("name,window", [("fp8_e4m3", 600), ("int8_per_token_head", 520), ("bfloat16", 2000)])
def test_split_decode_with_sliding_window(name, window):
    sc = _decode_scenario(name, [1300, 700], hq=6, hkv=3, d=32, seed=2, window=window)
    out, launches = _run(sc)
    assert launches[0].grid[2] == max(1, min(1300, window) // 256)
    assert _rel(out, _reference(sc)) < 1e-3


@pytest.mark.parametrize(
    "name,granularity", [("fp8_e4m3", "channel"), ("int8", "head"), ("fp8_per_token_head", None), ("float32", None)]
)
def test_split_decode_with_rotation_and_channel_scales(name, granularity):
    sc = _decode_scenario(name, [900, 520], hq=8, hkv=2, d=64, granularity=granularity, rotate=True, seed=3)
    out, launches = _run(sc)
    assert launches[0].grid == (2, 2, 3)
    assert _rel(out, _reference(sc)) < (1e-5 if name == "float32" else 1e-3)


def test_split_decode_on_sm80_path():
    sc = _decode_scenario("fp8_e5m2", [800], hq=4, hkv=1, d=32, seed=4)
    with emulate_arch(80):
        out, launches = _run(sc)
    assert launches[0].kwargs["FP8_NATIVE"] is False and launches[0].grid == (1, 1, 3)
    assert _rel(out, _reference(sc)) < 1e-3


def test_mixed_batches_are_not_split():
    sc = _decode_scenario("fp8_e4m3", [1100, 600], hq=4, hkv=2, d=32, seed=5, q_lens=[3, 1])
    out, launches = _run(sc)
    assert len(launches) == 1 and launches[0].grid[2] == 1 and not launches[0].kwargs["SPLIT"]
    assert _rel(out, _reference(sc)) < 1e-3


def test_num_sms_parameter():
    sc = _decode_scenario("int8", [1100], hq=4, hkv=2, d=32, seed=6)
    _, launches = _run(sc, num_sms=4)  # 2 programs, 4 SMs -> 2 segments
    assert launches[0].grid == (1, 2, 2)
    _, launches = _run(sc, num_sms=2)
    assert launches[0].grid == (1, 2, 1) and len(launches) == 1


def test_32k_decode_with_8_kv_heads_launches_enough_programs_for_an_h200():
    """Captured at launch: the Llama-3-8B shape (32 q heads, 8 kv heads, head_dim 128) at 32,768 tokens."""
    dt = resolve_cache_dtype("fp8_e4m3")
    one = torch.ones(8)
    layer = PagedLayer(torch.zeros(4, 2, 16, 8, 128, dtype=dt.storage), dt, one, one)
    meta = StepMetadata.build([0], torch.zeros(1, 2048, dtype=torch.int32), [32768])
    with capture(arch=90) as launches:
        triton_attend(layer, torch.zeros(1, 32, 128, dtype=torch.bfloat16), meta, 128**-0.5)
    assert launches[0].grid == (1, 8, 17) and launches[0].programs == 136 >= 132


@pytest.mark.parametrize("name,tol", [("float32", 1e-5), ("fp8_e4m3", 1e-3)])
def test_32k_decode_merged_output_equals_unsplit_reference(name, tol):
    """Batch 1, 32,768 tokens, 8 kv heads, run; head_dim 16 (256-key tiles) keeps the interpreter to ~1k loop steps."""
    sc = _decode_scenario(name, [32768], hq=8, hkv=8, d=16, seed=7)
    out, launches = _run(sc)
    assert launches[0].programs == 136 and launches[0].grid == (1, 8, 17)
    ref = _reference(sc)
    assert _rel(out, ref) < tol
