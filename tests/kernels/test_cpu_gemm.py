"""The few-row linear (``csrc/small_gemm.h``) against its specification, written in torch: bit for bit.

The reference spells out the kernel's order (module docstring of the header): products of two 16-bit values are
exact in fp32, so an fp32 add of the product is the kernel's fused multiply-add; lane ``l`` of eight sums
``k = l, l + 8, ...``, the lanes are added as ``((0+4)+(2+6)) + ((1+5)+(3+7))``, then the bias, then one rounding.
fp32 operands (``--batch-invariant`` on an fp32 model) take the same order; there the fused multiply-add is
emulated in fp64, where the product is exact and the sum rounds once before the rounding to fp32. That differs
from one rounding only when the fp64 sum lands exactly on an fp32 midpoint (about 2**-29 of the adds); these
seeds' operands have none, and a case that did would fail here, not pass.
"""

import os

import pytest
import torch

from qkv.eval.machine import cpu_info
from qkv.kernels.cpu_gemm import SmallGemm
from qkv.registry import default_cache_dir

SHAPES = [  # (M, N, K): SmolLM2's projections, tails in N (not a multiple of 4), K (of 8) and M (of 3), and from
    # 6 rows on the tiles widened once per thread (the header's SMALL_GEMM_WIDEN_ROWS)
    (1, 576, 576),
    (2, 192, 576),
    (1, 576, 1536),
    (3, 1537, 1536),
    (5, 7, 13),
    (8, 1536, 576),
    (2, 3, 5),
    (6, 9, 13),
    (40, 193, 1536),
    (97, 576, 576),
    # AVX-512 builds take eight weight rows a tile and x in groups of six from 6 rows on: tails of 1 to 5 rows
    (7, 16, 8),
    (10, 24, 20),
    (11, 17, 576),
    (15, 8, 64),
    (16, 40, 24),
]


@pytest.fixture(scope="module")
def gemm() -> SmallGemm:
    g = SmallGemm.build(default_cache_dir() / "kernels")
    assert g is not None, "every x86 machine this project runs on has AVX2, FMA and F16C"
    return g


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    k8 = -(-k // 8) * 8
    xf = torch.nn.functional.pad(x.float(), (0, k8 - k)).view(m, 1, k8 // 8, 8)
    wf = torch.nn.functional.pad(w.float(), (0, k8 - k)).view(1, w.shape[0], k8 // 8, 8)
    acc = torch.zeros(m, w.shape[0], 8)
    fp32 = x.dtype == torch.float32
    for c in range(k8 // 8):  # one vector of eight lanes at a time, in order
        if fp32:  # the fused multiply-add (module docstring)
            acc = (acc.double() + xf[:, :, c].double() * wf[:, :, c].double()).float()
        else:
            acc = acc + xf[:, :, c] * wf[:, :, c]
    a = acc[..., :4] + acc[..., 4:]  # (0+4), (1+5), (2+6), (3+7)
    b = a[..., :2] + a[..., 2:]  # (0+4)+(2+6), (1+5)+(3+7)
    s = b[..., 0] + b[..., 1]
    if bias is not None:
        s = s + bias.float()
    return s.to(x.dtype)


def operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.exactness  # the rerun on AVX2 code paths checks that build's bits too
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_is_its_reference_bit_for_bit(gemm, m, n, k, dtype):
    x, w, b = operands(m, n, k, dtype)
    for bias in (b, None):
        y = gemm(x, w, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(bits(y), bits(reference(x, w, bias)))


@pytest.mark.exactness  # the rerun on AVX2 code paths checks that build's bits too
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_result_does_not_depend_on_its_neighbours_or_the_threads(gemm, dtype):
    """Alone, each 16-bit row takes the one-row tiles on the 16-bit weights; in a call of 41 it shares groups of
    three with its neighbours on tiles widened first: the same bits either way (fp32 weights are read as they
    are, K being whole vectors)."""
    x, w, b = operands(41, 1537, 1536, dtype, seed=1)
    together = gemm(x, w, b)
    alone = torch.cat([gemm(x[i : i + 1], w, b) for i in range(41)])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = gemm(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(together), bits(alone))
    assert torch.equal(bits(together), bits(one_thread))


@pytest.mark.exactness  # the rerun on AVX2 code paths checks that build's bits too
def test_the_wide_path_is_built_where_the_cpu_has_avx512(gemm):
    """An AVX-512 build multiplies calls of six rows or more two weight rows to a register (the same bits, checked
    by the tests above on such a machine); the others keep the AVX2 tiles. Says which one the tests above checked."""
    flags = set(cpu_info()["flags"])
    march = os.environ.get("QKV_CPU_MARCH", "native")  # .ci/run's rerun builds for x86-64-v3 (AVX2)
    avx512 = {"avx512f", "avx512dq"} <= flags if march == "native" else march == "x86-64-v4"
    want = 512 if avx512 else 256
    print(f"few-row kernel: {gemm.vector_bits}-bit vectors from 6 rows on")
    assert gemm.vector_bits == want


def test_exact_where_the_sums_are_exact(gemm):
    """Small integers: every product and partial sum is exact, so the result is the true value, as torch's."""
    x = torch.arange(-8, 8, dtype=torch.bfloat16).repeat(2, 4)  # [2, 64]
    w = torch.arange(64 * 3, dtype=torch.bfloat16).remainder(7).view(3, 64) - 3
    want = (x.double() @ w.double().T).to(torch.bfloat16)
    assert torch.equal(gemm(x, w), want)
    assert gemm(x, w).tolist() == torch.nn.functional.linear(x, w).tolist()


def test_bad_operands_name_what_is_wrong(gemm):
    x, w, b = operands(1, 8, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\].*\[1, 16\] and \[8, 8\]"):
        gemm(x, w[:, :8])
    with pytest.raises(ValueError, match="one dtype.*torch.float32, torch.bfloat16"):
        gemm(x.float(), w)
    with pytest.raises(ValueError, match=r"bias of shape \[8\]"):
        gemm(x, w, b[:4])
    assert gemm(x[:0], w).shape == (0, 8)
