"""Clipping ratios for the per-token 4-bit caches (``int4_per_token_head``, ``k8v4_per_token_head``).

Why: a per-token scale ``amax / qmax`` spends int4's 16 levels on the row's single largest value; most of a
row is small, so the round trip of everything else is coarse. Shrinking the range by a ratio ``r < 1``
saturates the few values past ``r * amax`` and halves the error of the rest where ``r`` is well chosen. The
right ratio depends on the layer's distribution (and on rotation, which flattens it), so it is calibrated:
per layer and per side (K, V), the ratio of :data:`CLIP_RATIOS` whose quantize-dequantize round trip,
computed with the cache's own quantizer, has the least squared error over the calibration tokens. 1.0 (vLLM's
rule) is a candidate and ties go to the larger ratio, so the choice never does worse than no clipping on
the calibration set. Errors are accumulated while the samples stream through the engine: no tensor is kept.

The engine applies the ratios as ``|scale| = amax / qmax * r`` (:func:`qkv.kernels.quant.dynamic_scales`);
they travel in the checkpoint as ``self_attn.k_clip`` / ``v_clip`` (calibrate/FORMAT.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from qkv.kernels.quant import CacheDtype, dequantize, dynamic_scales, hadamard_rotate, quantize
from qkv.key_basis import KeyBasis, KeyStats
from qkv.scoring import prefill_logits

from .stats import single_thread

__all__ = ["CLIP_RATIOS", "ClipErrors", "LayerClip", "choose_clips", "observe_clip_errors", "observe_key_bases"]

CLIP_RATIOS = tuple(round(1.0 - 0.025 * i, 3) for i in range(25))  # 1.0, 0.975, ..., 0.4


class ClipErrors:
    """Summed squared round-trip error of one layer's K or V, for every candidate ratio."""

    def __init__(self, dt: CacheDtype, kv: int, ratios: tuple[float, ...] = CLIP_RATIOS) -> None:
        # as the fp32 values the cache multiplies by, which is also what the checkpoint stores
        self.dt, self.kv = dt, kv
        self.ratios = tuple(float(torch.tensor(r, dtype=torch.float32)) for r in ratios)
        self.sse = torch.zeros(len(ratios), dtype=torch.float64)
        self.values = 0

    def update(self, x: torch.Tensor) -> None:
        """``x``: ``[T, H, D]`` as the cache write quantizes it (rotated already when the cache rotates)."""
        x = x.to(torch.float32)
        for i, r in enumerate(self.ratios):
            scale = dynamic_scales(x, self.dt, self.kv, r)
            y = dequantize(quantize(x, scale, self.dt, self.kv), scale, self.dt, torch.float32)
            self.sse[i] += float(((y - x).double() ** 2).sum())
        self.values += x.numel()

    def best(self) -> float:
        """The ratio of least error; the larger ratio on ties (1.0 first in :data:`CLIP_RATIOS`)."""
        return self.ratios[int(torch.argmin(self.sse))]

    def mse(self, ratio: float) -> float:
        return float(self.sse[self.ratios.index(ratio)]) / max(self.values, 1)


@dataclass
class LayerClip:
    """One layer's chosen ratios and the round-trip MSE they give, against no clipping (ratio 1.0)."""

    layer: int
    k_clip: float
    v_clip: float
    k_mse: float
    v_mse: float
    k_mse_unclipped: float
    v_mse_unclipped: float


def observe_clip_errors(
    engine, chunks: list[list[int]], dt: CacheDtype, rotation: str | None, progress: bool = True
) -> dict[tuple[int, int], ClipErrors]:
    """Round-trip errors of every layer's K (side 0) and V (side 1) over ``chunks``, keyed ``(layer, side)``."""
    errors = {(s.layer_idx, kv): ClipErrors(dt, kv) for s in engine.layer_specs for kv in (0, 1)}

    def observer(layer_idx: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor) -> None:
        with single_thread():
            for kv, x in enumerate((key, value)):
                errors[layer_idx, kv].update(hadamard_rotate(x) if rotation == "hadamard" else x)

    run_samples(engine, chunks, observer, "calibrating clipping", progress)
    return errors


def observe_key_bases(engine, chunks: list[list[int]], progress: bool = True) -> dict[int, KeyBasis]:
    """Every layer's key basis (:mod:`qkv.key_basis`: K's mean, and its smoothing against Q) over ``chunks``,
    from an engine whose layers have none yet, so that the statistics are of K and Q as the model makes them."""
    stats = {s.layer_idx: KeyStats() for s in engine.layer_specs}

    def observer(layer_idx: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor) -> None:
        with single_thread():
            stats[layer_idx].update(query, key)

    run_samples(engine, chunks, observer, "calibrating the key basis", progress)
    return {i: st.basis() for i, st in stats.items()}


def run_samples(engine, chunks: list[list[int]], observer, desc: str, progress: bool) -> None:
    """Prefill every chunk through ``engine`` with ``observer`` on."""
    bar = tqdm(total=len(chunks), desc=desc, unit="sample", disable=not progress)
    for chunk in chunks:
        if len(chunk) > engine.max_model_len:
            raise ValueError(
                f"a sample has {len(chunk)} tokens, more than the model's max_model_len={engine.max_model_len}; "
                "lower --seq-len"
            )
        prefill_logits(engine, chunk, observer=observer, keep_logits=False)
        bar.update(1)
    bar.close()


def choose_clips(errors: dict[tuple[int, int], ClipErrors]) -> list[LayerClip]:
    """Each layer's best K and V ratios, with their MSE and the unclipped MSE (for the record)."""
    out = []
    for layer in sorted({i for i, _ in errors}):
        k, v = errors[layer, 0], errors[layer, 1]
        kc, vc = k.best(), v.best()
        out.append(LayerClip(layer, kc, vc, k.mse(kc), v.mse(vc), k.mse(1.0), v.mse(1.0)))
    return out
