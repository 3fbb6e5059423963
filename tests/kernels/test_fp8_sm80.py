"""fp8 without fp8 hardware (sm_80): integer encode/decode, bit-exact against torch, in both kernels.

``emulate_arch(80)`` makes the launchers take the path they take on an A100 (the cache
passed as uint8, ``FP8_NATIVE`` off), and the kernels then run, in the interpreter or
on a GPU. The native path (sm_89+) is checked beside it.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from support.paged import paged_scenario, write_step  # noqa: E402

from qkv.kernels import reference  # noqa: E402
from qkv.kernels.launch import capture, emulate_arch  # noqa: E402
from qkv.kernels.paged import PagedLayer, StepMetadata  # noqa: E402
from qkv.kernels.quant import resolve_cache_dtype  # noqa: E402
from qkv.kernels.triton_attention import triton_attend  # noqa: E402
from qkv.kernels.triton_cache_write import triton_write  # noqa: E402
from qkv.kernels.triton_fp8 import fp8_decode_bits, fp8_encode_bits, fp8_format  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


@triton.jit
def _decode_kernel(src_ptr, out_ptr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, INTEGER: tl.constexpr):
    i = tl.arange(0, 256)
    x = tl.load(src_ptr + i)
    if INTEGER:  # noqa: SIM108 - a constexpr branch the JIT prunes; a ternary would compile both sides
        y = fp8_decode_bits(x, MANT_BITS, MIN_EXP)
    else:
        y = x.to(tl.float32)
    tl.store(out_ptr + i, y)


@triton.jit
def _encode_kernel(src_ptr, out_ptr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, fp8_encode_bits(tl.load(src_ptr + i), MANT_BITS, MIN_EXP))


def _decode(storage, integer):
    src = ALL_BYTES.to(DEVICE)
    out = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](src if integer else src.view(storage), out, *fp8_format(storage), integer)
    return out.cpu()


@pytest.mark.parametrize("storage", FP8, ids=["e4m3", "e5m2"])
def test_integer_decode_of_every_byte_is_bit_exact(storage):
    want = ALL_BYTES.view(storage).float()
    got = _decode(storage, integer=True)
    # fp32 bits, so -0.0, subnormals, infinities and NaN payloads all count
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("storage", FP8, ids=["e4m3", "e5m2"])
def test_native_decode_of_every_byte(storage):
    want = ALL_BYTES.view(storage).float()
    got = _decode(storage, integer=False)
    finite = torch.isfinite(want)
    assert int(finite.sum()) == (254 if storage == torch.float8_e4m3fn else 248)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
    if DEVICE == "cuda":  # the interpreter's own cast decodes 0x7F as 480 (a Triton bug); NaN never reaches a softmax
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
            got[torch.isinf(want)], want[torch.isinf(want)]
        )


@pytest.mark.parametrize("storage", FP8, ids=["e4m3", "e5m2"])
def test_integer_encode_of_every_finite_value_is_bit_exact(storage):
    values = ALL_BYTES.view(storage).float()
    finite = torch.isfinite(values)
    src = torch.where(finite, values, torch.zeros(()))
    out = torch.empty(256, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(1,)](src.to(DEVICE), out, *fp8_format(storage))
    assert torch.equal(out.cpu()[finite], ALL_BYTES[finite])  # +-0, subnormals, normals, +-qmax


SLOTS = [3, -1, 0, 9, 15, 12, 6]


def _sentinel_layer(dt, h, d, k_scale, v_scale, rotate, device):
    """A 4-block cache of 0x5A bytes (and -3.25 dynamic scales): what a write leaves untouched stays visible."""
    cache = torch.full((4, 2, 4, h, d), 0x5A, dtype=torch.uint8, device=device).view(dt.storage)
    sc = torch.full((4, 2, 4, h), -3.25, device=device)

    def mv(t):
        return None if t is None else t.to(device)

    return PagedLayer(cache, dt, mv(k_scale), mv(v_scale), sc if dt.dynamic else None, rotate), sc


def _write(name, key, value, k_scale, v_scale, arch, rotate=False):
    dt = resolve_cache_dtype(name)
    h, d = key.shape[1:]
    layer, sc = _sentinel_layer(dt, h, d, k_scale, v_scale, rotate, DEVICE)
    meta = write_step(SLOTS[: key.shape[0]], DEVICE)
    if arch is None:
        triton_write(layer, key.to(DEVICE), value.to(DEVICE), meta)
    else:
        with emulate_arch(arch):
            triton_write(layer, key.to(DEVICE), value.to(DEVICE), meta)
    return layer.kv.cpu().view(torch.uint8), sc.cpu()


@pytest.mark.parametrize(
    "name,granularity,rotate",
    [
        ("fp8_e4m3", "head", False),
        ("fp8_e5m2", "head", False),
        ("fp8_e4m3", "channel", True),
        ("fp8_e5m2", "channel", False),
        ("fp8_per_token_head", None, False),
        ("fp8_per_token_head", None, True),
    ],
)
def test_sm80_cache_write_bytes_equal_torch(name, granularity, rotate):
    dt = resolve_cache_dtype(name)
    g = torch.Generator().manual_seed(1)
    t, h, d = 7, 3, 32
    # magnitudes from 2^-12 to 2^10 (subnormals, ties, saturation), NaN and +-inf
    mag = torch.exp2(torch.randint(-12, 11, (2, t, h, d), generator=g).float())
    key, value = torch.randn(2, t, h, d, generator=g) * mag
    # rotated or dynamic, inf - inf and inf / inf make NaNs whose sign the platform picks
    if granularity and not rotate:
        key[0, 0, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    key[2, 1, :6] = torch.tensor([1.98, 464.0, -500.0, 2**-10, -(2**-10), 0.0])
    k_scale = v_scale = None
    if granularity == "head":
        k_scale, v_scale = torch.tensor([1.0, 0.37, 2.0]), torch.tensor([0.25, 0.013, 4.0])
    elif granularity == "channel":
        k_scale, v_scale = torch.rand(h, d, generator=g) + 0.1, torch.rand(h, d, generator=g) * 0.1 + 0.01
    ref, ref_sc = _sentinel_layer(dt, h, d, k_scale, v_scale, rotate, "cpu")
    reference.write(ref, key, value, write_step(SLOTS))
    for arch in (80, None):  # integer path, then the native one: same bytes
        got, got_sc = _write(name, key, value, k_scale, v_scale, arch, rotate)
        assert torch.equal(got, ref.kv.view(torch.uint8)), f"arch {arch}"
        assert torch.equal(got_sc.view(torch.int32), ref_sc.view(torch.int32))


def test_sm80_launch_passes_uint8_and_no_fp8_conversion():
    dt = resolve_cache_dtype("fp8_e4m3")
    one = torch.ones(1)
    layer = PagedLayer(torch.zeros(2, 2, 4, 1, 16, dtype=dt.storage), dt, one, one)
    q = torch.zeros(1, 2, 16)
    for arch, native in ((80, False), (89, True), (90, True)):
        with capture(arch) as launches:
            triton_write(layer, q[:, :1], q[:, :1], write_step([0]))
            triton_attend(layer, q, StepMetadata.build([0], torch.zeros(1, 2, dtype=torch.int32), [3]), 0.25)
        assert [launch.kwargs["FP8_NATIVE"] for launch in launches] == [native, native]
        assert {launch.args[2].dtype for launch in launches} == {torch.uint8 if arch == 80 else dt.storage}


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp8_per_token_head"])
def test_sm80_attention_equals_native_attention(name):
    """Decoding with integers gives the same fp32 values, so the outputs are identical."""
    sc = paged_scenario(name, [23, 9], [5, 1], hq=4, hkv=2, d=32, block_size=8, seed=2)  # stale NaNs elsewhere
    ref = reference.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    dev = sc.on(DEVICE)
    native = triton_attend(dev.layer, dev.query, dev.meta, dev.sm_scale).cpu()
    with emulate_arch(80):
        integer = triton_attend(dev.layer, dev.query, dev.meta, dev.sm_scale).cpu()
    assert torch.equal(integer, native)
    assert ((integer - ref).abs().max() / ref.abs().max()).item() < 1e-3
