"""Observer properties on synthetic tensors: minmax never clips, percentile clips the stated fraction,
mse is never worse than minmax; plus the histogram statistics they rest on."""

import pytest
import torch

from qkv.calibrate.observers import MSE, MinMax, Percentile, make_observer, mse_per_head, scales_from_amax
from qkv.calibrate.stats import TensorStats
from qkv.kernels.quant import resolve_cache_dtype

FP8 = resolve_cache_dtype("fp8")
INT8 = resolve_cache_dtype("int8")


def _data(kind: str, shape=(4096, 2, 16), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":  # student-t like tails with a few large outliers, as K often has
        x = x / torch.rand(shape, generator=g).clamp(min=0.05).sqrt()
    elif kind == "uniform":
        x = torch.rand(shape, generator=g) * 2 - 1
    x[:, 1] *= 3.0  # heads of different range
    return x


def _stats(x: torch.Tensor, reservoir: int = 0, chunks: int = 4) -> TensorStats:
    s = TensorStats(x.shape[1], reservoir)
    for part in x.chunk(chunks, dim=0):  # fed in pieces, as samples arrive
        s.update(part)
    return s


def _sse(x, amax, dt, per_head):
    scale = scales_from_amax(amax, dt)
    if not per_head:
        return float(mse_per_head(x.reshape(-1, 1, 1), scale, dt).sum())
    return float(mse_per_head(x, scale, dt).sum())


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dt", [FP8, INT8], ids=["fp8", "int8"])
def test_minmax_is_the_true_absmax_and_never_clips(per_head, dt):
    x = _data("heavy")
    s = _stats(x)
    amax = MinMax().amax(s, per_head, dt)
    want = x.abs().amax(dim=(0, 2)) if per_head else x.abs().max().reshape(1)
    assert torch.equal(amax, want)
    scale = scales_from_amax(amax, dt)
    assert s.clip_rate(scale * dt.qmax) == 0.0
    view = scale if per_head else scale.expand(x.shape[1])
    assert (x.abs() / view[None, :, None] <= dt.qmax * (1 + 1e-6)).all()


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("p", [99.0, 99.9, 99.99])
def test_percentile_clips_the_stated_fraction(per_head, p):
    x = _data("heavy", shape=(50_000, 2, 8), seed=1)
    s = _stats(x)
    amax = Percentile(p).amax(s, per_head, FP8)
    want = 1.0 - p / 100.0
    if per_head:
        frac = (x.abs() > amax[None, :, None]).float().mean(dim=(0, 2))
        assert torch.allclose(frac, torch.full_like(frac, want), rtol=0.05, atol=2.0 / (50_000 * 8))
    else:
        frac = float((x.abs() > amax).float().mean())
        assert frac == pytest.approx(want, rel=0.05, abs=2.0 / x.numel())
    # the reported clip rate (from the histogram) says the same
    assert s.clip_rate(amax) == pytest.approx(want, rel=0.05, abs=2.0 / x.numel())
    assert (amax <= s.absmax(per_head)).all()


def test_percentile_100_is_minmax():
    x = _data("gauss")
    s = _stats(x)
    assert torch.equal(Percentile(100.0).amax(s, True, INT8), MinMax().amax(s, True, INT8))


@pytest.mark.parametrize("kind", ["gauss", "heavy", "uniform"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dt", [FP8, INT8], ids=["fp8", "int8"])
def test_mse_never_worse_than_minmax(kind, per_head, dt):
    x = _data(kind)
    obs = MSE()
    s = _stats(x, reservoir=obs.reservoir)
    mse_amax = obs.amax(s, per_head, dt)
    mm_amax = MinMax().amax(s, per_head, dt)
    assert (mse_amax <= mm_amax).all()
    assert _sse(x, mse_amax, dt, per_head) <= _sse(x, mm_amax, dt, per_head) * (1 + 1e-9)


def test_mse_clips_heavy_tails_in_int8():
    x = _data("heavy")
    obs = MSE()
    s = _stats(x, reservoir=obs.reservoir)
    mse_amax, mm_amax = obs.amax(s, True, INT8), MinMax().amax(s, True, INT8)
    assert (mse_amax < mm_amax).all()
    assert _sse(x, mse_amax, INT8, True) < 0.9 * _sse(x, mm_amax, INT8, True)


def test_reservoir_is_bounded_and_uniform():
    s = TensorStats(2, reservoir=1000, seed=3)
    for i in range(20):
        s.update(torch.full((100, 2, 10), float(i)))  # 1000 values per update and head
    r = s.reservoir(per_head=True)
    assert r.shape == (1000, 2, 1)
    assert torch.equal(r[:, 0], r[:, 1])  # heads sampled at the same positions
    counts = torch.bincount(r[:, 0, 0].long(), minlength=20).float()
    assert counts.min() > 20 and counts.max() < 90  # ~50 of each of the 20 updates


def test_stats_reject_non_finite_and_bad_shapes():
    s = TensorStats(2)
    with pytest.raises(ValueError, match="inf or NaN"):
        s.update(torch.tensor([[[1.0], [float("inf")]]]))
    with pytest.raises(ValueError, match=r"\[T, 2, D\]"):
        s.update(torch.zeros(3, 4))


def test_zero_tensor_gets_a_valid_scale():
    s = _stats(torch.zeros(16, 2, 4), chunks=1)
    scale = scales_from_amax(MinMax().amax(s, True, FP8), FP8)
    assert torch.equal(scale, torch.ones(2))


def test_make_observer_errors():
    with pytest.raises(ValueError, match="unknown observer 'foo'"):
        make_observer("foo")
    with pytest.raises(ValueError, match=r"--percentile must be in \(0, 100\]"):
        make_observer("percentile", 0.0)
