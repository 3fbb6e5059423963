"""Calibration proper: run samples through the engine, observe the K/V the cache would store, pick scales.

The per-token 4-bit modes need no scales; for them calibration chooses clipping ratios
(:mod:`qkv.calibrate.clipping`) from the same observed tensors.

This module only observes and computes; :mod:`qkv.calibrate.checkpoint` writes
the result (gpt-fast's split between calibrating and converting).

Observation goes through :func:`qkv.scoring.prefill_logits` on an engine with an
unquantized cache (the model's dtype), so the statistics are of exactly the
tensors the cache stores: K after RoPE (and k_norm), V as projected.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qkv.config import EngineConfig
from qkv.kernels.quant import (
    PACKED_CACHE_DTYPES,
    ROTATIONS,
    STATIC_CACHE_DTYPES,
    CacheDtype,
    check_rotation,
    hadamard_rotate,
    resolve_cache_dtype,
)
from qkv.key_basis import KeyBasis
from qkv.llm import LLM
from qkv.options import option, validate_options
from qkv.scoring import prefill_logits

from .clipping import LayerClip, choose_clips, observe_clip_errors, observe_key_bases
from .data import PACKINGS, RawData, Samples, build_samples
from .observers import OBSERVER_NAMES, MinMax, Observer, make_observer, scales_from_amax
from .selfgen import GEN_BATCH, generate_samples
from .stats import TensorStats, single_thread

__all__ = [
    "CALIBRATED_DTYPES",
    "Calibration",
    "CalibrationSpec",
    "LayerResult",
    "STRATEGIES",
    "calibrate",
    "calibrate_grid",
    "observe",
    "choose_scales",
    "load_engine",
    "resolve_target",
]

logger = logging.getLogger("qkv")

STRATEGIES = ("tensor", "head", "channel")
# Static scales are calibrated for e4m3 and int8; e5m2's range needs none (vLLM keeps it at 1.0). The 4-bit
# per-token modes get clipping ratios.
CALIBRATED_DTYPES = (
    *(n for n in STATIC_CACHE_DTYPES if resolve_cache_dtype(n).name != "fp8_e5m2"),
    *PACKED_CACHE_DTYPES,
)


@dataclass
class LayerResult:
    layer: int
    num_kv_heads: int
    k_amax: torch.Tensor  # clipping threshold actually used, [1], [H] or [H, D]
    v_amax: torch.Tensor
    k_scale: torch.Tensor  # fp32 amax / qmax
    v_scale: torch.Tensor
    k_observed_amax: torch.Tensor  # the true absmax, same shape
    v_observed_amax: torch.Tensor
    k_clip_rate: float
    v_clip_rate: float


@dataclass
class Calibration:
    """Everything a writer needs: scales per layer and the record of how they were obtained."""

    model: str
    model_path: Path
    kv_dtype: CacheDtype
    strategy: str
    observer: dict
    layers: list[LayerResult]
    samples_info: dict
    num_samples: int
    num_tokens: int
    model_dtype: str
    seed: int
    wall_time_s: float = 0.0
    observe_time_s: float = 0.0
    rotation: str | None = None  # "hadamard": scales of rotated K/V (qkv extension)
    skip_layers: list[int] | None = None  # auto-skip's choice of layers kept out of the cache dtype
    skip_dtype: str = "auto"  # what they hold: the model's dtype, or a per-token 8-bit dtype (SKIP_DTYPES)
    sensitivity: dict | None = None  # auto-skip's per-layer measurements
    fold: dict | None = None  # export-vllm --fold: what was folded into the weights before these scales
    clips: list[LayerClip] | None = None  # per-token 4-bit modes: the ratios chosen instead of scales (no layers)
    bases: dict[int, KeyBasis] | None = None  # per-token 4-bit modes with --key-basis: K's centring and smoothing
    stats: dict[tuple[int, str], TensorStats] | None = field(default=None, repr=False)  # what the scales came from
    date: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )

    @property
    def kind(self) -> str:
        return self.kv_dtype.kind  # "float" (fp8) or "int" (int8)

    @property
    def num_layers(self) -> int:
        return len(self.clips) if self.clips is not None else len(self.layers)


def resolve_target(kv_cache_dtype: str, strategy: str, observer: str = "minmax") -> CacheDtype:
    """The cache dtype scales are calibrated for: static fp8 (e4m3) or int8."""
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "channel" and observer != "minmax":
        raise ValueError(
            f"--strategy channel takes --observer minmax only (got {observer}): the statistics "
            f"keep an exact absmax per channel, not a histogram"
        )
    dt = resolve_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype not in CALIBRATED_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype}: calibration makes static scales for fp8 "
            f"(e4m3) or int8, or clipping ratios for the 4-bit per-token modes; {dt.name} needs none"
        )
    if dt.dynamic and (strategy != "tensor" or observer not in ("minmax", "mse")):
        raise ValueError(
            f"--kv-cache-dtype {dt.name} computes a scale per token; calibration chooses one clipping ratio per "
            f"layer for K and for V by round-trip MSE, so --strategy and --observer do not apply"
        )
    return dt


def load_engine(model: str, dtype: str = "auto", *, seq_len: int, num_seqs: int = 1, device: str | None = None):
    """An engine with an unquantized cache (the model's dtype) for ``num_seqs`` sequences of ``seq_len``
    tokens at once, prefilled in one chunk; load failures become one-line ValueErrors."""
    engine_defaults = EngineConfig(model=model)
    blocks_per_seq = -(-seq_len // engine_defaults.block_size) + 1
    try:
        return LLM(
            model,
            dtype=dtype,
            kv_cache_dtype="auto",
            num_blocks=num_seqs * blocks_per_seq + 2,
            device=device,
            max_num_batched_tokens=max(engine_defaults.max_num_batched_tokens, seq_len),
            enable_prefix_caching=False,
        )
    except Exception as e:  # UnknownModelError, CheckpointError, OSError, transformers' errors, ...
        raise ValueError(f"cannot load model {model!r}: {e}") from None


def observe(
    engine,
    chunks: list[list[int]],
    reservoir: int = 0,
    seed: int = 0,
    progress: bool = True,
    rotations: tuple[str, ...] = ("none",),
) -> dict[tuple[int, str], TensorStats] | dict[str, dict[tuple[int, str], TensorStats]]:
    """Statistics of every layer's K and V over ``chunks``, keyed ``(layer, "k" | "v")``.

    With several ``rotations`` one pass fills one set per rotation (returned as
    ``{rotation: stats}``): a ``hadamard`` set sees ``hadamard_rotate(K)``, exactly
    the fp32 values the rotated cache write quantizes.
    """
    for r in rotations:
        for spec in engine.layer_specs:
            check_rotation(r, spec.head_dim)
    sets: dict[str, dict[tuple[int, str], TensorStats]] = {r: {} for r in rotations}
    for stats in sets.values():
        for spec in engine.layer_specs:
            for j, kind in enumerate("kv"):
                stats[spec.layer_idx, kind] = TensorStats(
                    spec.num_kv_heads, reservoir, seed=seed * 100003 + 2 * spec.layer_idx + j
                )

    def observer(layer_idx: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor) -> None:
        with single_thread():
            for r, stats in sets.items():
                k, v = (hadamard_rotate(key), hadamard_rotate(value)) if r == "hadamard" else (key, value)
                stats[layer_idx, "k"].update(k)
                stats[layer_idx, "v"].update(v)

    bar = tqdm(total=len(chunks), desc="calibrating", unit="sample", disable=not progress)
    for chunk in chunks:
        if len(chunk) > engine.max_model_len:
            raise ValueError(
                f"a sample has {len(chunk)} tokens, more than the model's "
                f"max_model_len={engine.max_model_len}; lower --seq-len"
            )
        prefill_logits(engine, chunk, observer=observer, keep_logits=False)
        bar.update(1)
    bar.close()
    return sets[rotations[0]] if len(rotations) == 1 else sets


def choose_scales(
    stats: dict[tuple[int, str], TensorStats], observer: Observer, dt: CacheDtype, strategy: str
) -> list[LayerResult]:
    per_head = strategy == "head"
    out = []
    for layer in sorted({i for i, _ in stats}):
        res = {}
        for kind in "kv":
            s = stats[layer, kind]
            if strategy == "channel":  # minmax per channel: nothing is clipped
                amax = s.channel_absmax()
                res[kind] = (amax, scales_from_amax(amax, dt), amax.clone(), 0.0)
                continue
            with single_thread():
                amax = observer.amax(s, per_head, dt).to(torch.float32)
            scale = scales_from_amax(amax, dt)
            res[kind] = (amax, scale, s.absmax(per_head), s.clip_rate(scale * dt.qmax))
        out.append(
            LayerResult(
                layer,
                stats[layer, "k"].num_heads,
                res["k"][0],
                res["v"][0],
                res["k"][1],
                res["v"][1],
                res["k"][2],
                res["v"][2],
                res["k"][3],
                res["v"][3],
            )
        )
    return out


@dataclass
class CalibrationSpec:
    """What to calibrate and on how much data: ``qkv calibrate``'s flags and :func:`calibrate`'s keywords, whose
    defaults are written here once. Checked when built, before any model loads."""

    kv_cache_dtype: str = option(
        "fp8",
        "cache dtype the scales are for (fp8 = e4m3); for the 4-bit per-token modes, the clipping ratios",
        choices=CALIBRATED_DTYPES,
    )
    strategy: str = option(
        "tensor",
        "one scale per layer for K and for V, one per kv head (compressed-tensors attn_head), "
        "or one per kv head and channel (qkv extension: K folded into q, V into the output)",
        choices=STRATEGIES,
    )
    rotation: str = option(
        "none",
        "qkv extension: calibrate scales of Hadamard-rotated K/V (the engine then rotates)",
        choices=ROTATIONS,
        flag="--kv-rotation",
    )
    observer: str = option(
        "minmax",
        "minmax: absmax over all samples; percentile: clip at --percentile of |x|; "
        "mse: clipping ratio with the least quantize-dequantize error",
        choices=OBSERVER_NAMES,
    )
    percentile: float | None = option(None, "for --observer percentile (default 99.99)")
    num_samples: int = option(64, "number of calibration samples", ge=1)
    seq_len: int = option(512, "tokens per sample", ge=1)
    packing: str = option(
        "auto",
        "pack documents into seq-len chunks, or one truncated sample per row (auto: truncate for chat rows, "
        "pack otherwise)",
        choices=PACKINGS,
    )
    seed: int = option(0, "seed for the sample draw")
    key_basis: bool = option(
        False,
        "the 4-bit per-token modes: centre K and smooth it against Q per channel before the cache quantizes it "
        "(qkv extension; attention is unchanged in exact arithmetic), then choose the ratios for that K",
    )

    def __post_init__(self) -> None:
        validate_options(self)
        dt = resolve_target(self.kv_cache_dtype, self.strategy, self.observer)
        if self.key_basis and not dt.packed:
            raise ValueError(
                f"--key-basis applies to the 4-bit per-token modes, not {self.kv_cache_dtype}: their scales "
                "follow each token, so the basis changes no scale to recalibrate"
            )
        if self.percentile is not None and self.observer != "percentile":
            raise ValueError("--percentile only applies to --observer percentile")


def calibrate(
    model: str,
    samples: Samples | None = None,
    raw: RawData | None = None,
    *,
    dtype: str = "auto",
    device: str | None = None,
    progress: bool = True,
    llm=None,
    **spec,
) -> Calibration:
    """Calibrate ``model``'s KV scales.

    Give either ready ``samples`` (token chunks), or ``raw`` rows from
    :func:`qkv.calibrate.data.load_rows` to be tokenized here, or neither for
    data-free calibration on text the model generates itself. ``spec`` holds :class:`CalibrationSpec`'s
    fields (its defaults where not given).
    """
    t0 = time.perf_counter()
    sp = CalibrationSpec(**spec)
    dt = resolve_target(sp.kv_cache_dtype, sp.strategy, sp.observer)
    obs = make_observer(sp.observer, sp.percentile)
    strategy, rotation, seed, seq_len, num_samples = sp.strategy, sp.rotation, sp.seed, sp.seq_len, sp.num_samples
    if samples is not None:  # ready chunks: size the engine for the longest
        if not samples.chunks:
            raise ValueError("no samples to calibrate on")
        seq_len = max(len(c) for c in samples.chunks)
    if llm is None:  # auto-skip hands in its engine, so the model is loaded once for both
        llm = load_engine(
            model, dtype, seq_len=seq_len, device=device, num_seqs=GEN_BATCH if samples is None and raw is None else 1
        )
    engine = llm.llm_engine
    max_pos = getattr(engine.hf_config, "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings ({max_pos})")
    if samples is None:
        if raw is not None:
            samples = build_samples(raw, engine.tokenizer, num_samples, seq_len, seed, sp.packing)
        else:
            samples = generate_samples(llm, num_samples, seq_len, seed, progress)
    t1 = time.perf_counter()
    clips, layers, stats, bases = None, [], None, None
    if dt.dynamic:
        rot = None if rotation == "none" else rotation
        if sp.key_basis:  # the ratios are then chosen for the centred, smoothed K the cache will store
            bases = observe_key_bases(engine, samples.chunks, progress)
            engine.replace_kv_cache(engine.layer_specs, bases=bases)
        try:
            clips = choose_clips(observe_clip_errors(engine, samples.chunks, dt, rot, progress))
        finally:
            if bases is not None:  # auto-skip scores on this engine next and installs what it measures
                engine.replace_kv_cache(engine.layer_specs)
        strategy, described = "token_head", {"observer": "mse", "objective": "round-trip MSE per layer and side"}
        if bases:
            described = dict(described, key_basis="K centred and smoothed against Q (qkv.key_basis)")
    else:
        stats = observe(
            engine, samples.chunks, reservoir=obs.reservoir, seed=seed, progress=progress, rotations=(rotation,)
        )
        layers, described = choose_scales(stats, obs, dt, strategy), obs.describe()
    t2 = time.perf_counter()
    return Calibration(
        model=model,
        model_path=engine.model_path,
        kv_dtype=dt,
        strategy=strategy,
        observer=described,
        layers=layers,
        clips=clips,
        bases=bases,
        samples_info=samples.info,
        num_samples=len(samples.chunks),
        num_tokens=samples.num_tokens,
        model_dtype=str(engine.dtype).replace("torch.", ""),
        seed=seed,
        wall_time_s=t2 - t0,
        observe_time_s=t2 - t1,
        rotation=None if rotation == "none" else rotation,
        stats=stats,
    )


def calibrate_grid(
    model: str,
    raw: RawData,
    targets: list[tuple[str, str, str]],
    *,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    dtype: str = "auto",
    device: str | None = None,
) -> list[Calibration]:
    """Minmax scales for every ``(kv_cache_dtype, strategy, rotation)`` in ``targets`` from one pass.

    One engine observes the samples once, filling statistics for every rotation of the grid at
    the same time; each target then gets its scales from its rotation's statistics. This is what
    the evaluation's ``--search`` calibrates with.
    """
    t0 = time.perf_counter()
    dts = {(name, strategy): resolve_target(name, strategy) for name, strategy, _ in targets}  # fail early
    rotations = tuple(dict.fromkeys(rot for _, _, rot in targets))
    llm = load_engine(model, dtype, seq_len=seq_len, device=device)
    engine = llm.llm_engine
    samples = build_samples(raw, engine.tokenizer, num_samples, seq_len, seed)
    t1 = time.perf_counter()
    sets = observe(engine, samples.chunks, rotations=rotations, progress=False)
    if len(rotations) == 1:
        sets = {rotations[0]: sets}
    obs = MinMax()
    out = []
    for name, strategy, rot in targets:
        dt = dts[name, strategy]
        out.append(
            Calibration(
                model=model,
                model_path=engine.model_path,
                kv_dtype=dt,
                strategy=strategy,
                observer=obs.describe(),
                layers=choose_scales(sets[rot], obs, dt, strategy),
                samples_info=samples.info,
                num_samples=len(samples.chunks),
                num_tokens=samples.num_tokens,
                model_dtype=str(engine.dtype).replace("torch.", ""),
                seed=seed,
                wall_time_s=time.perf_counter() - t0,
                observe_time_s=time.perf_counter() - t1,
                rotation=None if rot == "none" else rot,
            )
        )
    return out
