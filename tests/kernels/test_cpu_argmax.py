"""Greedy sampling's argmax on the CPU kernels (kernels/csrc/argmax_rows.h) against torch's fp32 argmax.

The engine takes its greedy tokens from ``CpuKernels.argmax_rows``, so it must pick exactly what
``logits[rows].float().argmax(-1)`` picks: the first index of the maximum, the first NaN in a row that has one,
index 0 in a row of -inf, for every logits dtype and for vocabularies that are no multiple of the vector width.
"""

import pytest
import torch

from qkv.kernels.cpu_attention import CpuKernels
from qkv.registry import default_cache_dir

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return CpuKernels.build(default_cache_dir() / "kernels")


def _row(vocab: int, **at: float) -> torch.Tensor:
    """A row of zeros with the given values at the given indices (``at={"i5": 2.0}`` sets index 5)."""
    row = torch.zeros(vocab)
    for key, value in at.items():
        row[int(key[1:])] = value
    return row


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nan_and_infinities_give_torchs_index(kernels, dtype):
    v = 77  # two 32-wide rounds, one 8-wide round and a scalar tail of 5
    nan, inf = float("nan"), float("inf")
    logits = torch.stack(
        [
            _row(v, i10=3.0, i40=3.0),  # a tie: the first
            _row(v, i76=1.0),  # the maximum in the scalar tail
            _row(v, i3=2.0, i50=nan, i60=nan),  # the first NaN wins over any number
            _row(v, i75=nan),  # a NaN in the tail
            torch.full((v,), -inf),  # all -inf: index 0
            _row(v, i20=inf, i30=inf),
            _row(v, i66=1.0) - 1.0,  # -1 everywhere but 66
            torch.full((v,), -0.0),  # -0 == 0: index 0
        ]
    ).to(dtype)
    rows = list(range(logits.shape[0]))
    assert kernels.argmax_rows(logits, rows) == [10, 76, 50, 75, 0, 20, 66, 0]
    assert kernels.argmax_rows(logits, rows) == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 8, 31, 32, 49152, 49157])
def test_random_rows_match_torch(kernels, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(24, vocab, generator=g).to(dtype)
    rows = [23, 0, 7, 7, 12]  # any order, repeats allowed: the sampling rows of a step
    assert kernels.argmax_rows(logits, rows) == logits.float()[rows].argmax(-1).tolist()
    assert kernels.argmax_rows(logits, list(range(24))) == logits.float().argmax(-1).tolist()


def test_strided_logits_and_bad_arguments(kernels):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 200, generator=g)
    view = wide[:, ::2]  # no unit stride: copied first
    assert kernels.argmax_rows(view, [0, 5]) == view[[0, 5]].argmax(-1).tolist()
    assert kernels.argmax_rows(wide, []) == []
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 6\)"):
        kernels.argmax_rows(wide, [6])
    with pytest.raises(ValueError, match="logits must be a CPU"):
        kernels.argmax_rows(wide[0], [0])
    with pytest.raises(ValueError, match="logits has unsupported dtype"):
        kernels.argmax_rows(wide.double(), [0])
    with pytest.raises(ValueError, match="empty vocabulary"):
        kernels.argmax_rows(torch.zeros(2, 0), [0])
