"""The clipping-ratio search of the 4-bit caches, on tensors whose best ratio is known."""

import torch

from qkv.calibrate.clipping import CLIP_RATIOS, ClipErrors, choose_clips
from qkv.kernels.quant import resolve_cache_dtype

INT4 = resolve_cache_dtype("int4_per_token_head")


def test_ratios_start_unclipped_and_step_down():
    assert CLIP_RATIOS[0] == 1.0 and CLIP_RATIOS[-1] == 0.4 and len(CLIP_RATIOS) == 25


def test_grid_values_need_no_clipping_and_an_outlier_wants_it():
    """Rows on int4's signed grid (integers -8..7: scale 1) round-trip exactly at 1.0: ties go to the larger
    ratio, so 1.0 wins. Gaussian rows lose more to rounding than to a few saturated values: a ratio below 1 wins."""
    grid = torch.arange(-8, 8, dtype=torch.float32).view(1, 1, 16).expand(4, 2, 16)
    exact = ClipErrors(INT4, kv=0)
    exact.update(grid)
    assert exact.best() == 1.0 and exact.mse(1.0) == 0.0
    gauss = ClipErrors(INT4, kv=1)
    gauss.update(torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(0)))
    # 64 Gaussian values a row: the signed grid's best ratio is 0.95, about 4 % less error than 1.0
    assert gauss.best() == gauss.ratios[2] and gauss.mse(gauss.best()) < 0.97 * gauss.mse(1.0)
    assert gauss.values == 256 * 2 * 64


def test_choose_clips_reports_both_sides_per_layer():
    errs = {}
    g = torch.Generator().manual_seed(1)
    for layer in (0, 1):
        for kv in (0, 1):
            e = ClipErrors(INT4, kv)
            e.update(torch.arange(-8.0, 8.0).view(1, 1, 16) if kv == 0 else torch.randn(64, 1, 32, generator=g))
            errs[layer, kv] = e
    clips = choose_clips(errs)
    assert [c.layer for c in clips] == [0, 1]
    assert all(c.k_clip == 1.0 and c.v_clip < 1.0 and c.v_mse < c.v_mse_unclipped for c in clips)
