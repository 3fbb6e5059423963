"""Static K/V scales: read them from any checkpoint vLLM reads, validate them, hand them to the cache.

Sources, in the order vLLM remaps them:

* compressed-tensors / llm-compressor: ``quantization_config.kv_cache_scheme`` in
  ``config.json`` and ``model.layers.N.self_attn.k_scale`` / ``v_scale`` tensors
  (fp32 or the model dtype; shape ``[]``, ``[1]``, ``[Hkv]`` or ``[Hkv, 1, 1]``);
* ModelOpt: ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale``;
* legacy: one ``self_attn.kv_scale`` used for both K and V;
* qkv's own section (``config.json["qkv_kv_cache"]``) for what vLLM cannot read:
  static INT8 and the qkv extensions, with tensors in ``qkv_kv_scales.safetensors``;
* a bare ``.safetensors`` file (``--kv-scales FILE``) whose ``__metadata__`` carries
  ``type`` (``float``/``int``) and ``strategy``; without it, fp8 is assumed.

The per-token modes need no scales, but a calibrated 4-bit cache carries *clipping ratios*
(``qkv calibrate --kv-cache-dtype int4_per_token_head``): ``self_attn.k_clip`` / ``v_clip`` tensors of one
value per layer, in the same files and section, whose ``kv_cache_dtype`` names the mode they were chosen for,
and, where calibration chose one, a key basis (``self_attn.k_mean`` / ``k_smooth``, fp32 ``[Hkv, D]``:
:mod:`qkv.key_basis`).

qkv's extensions travel in the same metadata: ``strategy: channel`` (``[Hkv, D]``
scales), ``rotation: hadamard`` (scales of rotated K/V) and ``skip_layers``
(layers auto-skip chose to keep in BF16). Scales only fit the basis they were
calibrated in, so :func:`resolve_kv_cache` refuses a rotation flag that
disagrees with the checkpoint instead of silently producing garbage.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .kernels.quant import INT4_GRID, ROTATIONS
from .key_basis import KeyBasis
from .kv_cache import LayerSpec

__all__ = [
    "KVScales",
    "read_kv_scales",
    "resolve_scales",
    "resolve_kv_cache",
    "QKV_SECTION",
    "QKV_SCALES_FILE",
    "KV_ROTATION_CHOICES",
]

logger = logging.getLogger("qkv")

QKV_SECTION = "qkv_kv_cache"
QKV_SCALES_FILE = "qkv_kv_scales.safetensors"
_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj)\.)?(k_scale|v_scale|kv_scale|k_clip|v_clip|k_mean|k_smooth)$"
)
_warned: set[str] = set()


@dataclass
class KVScales:
    """Per-layer fp32 scales plus what they were calibrated for."""

    kind: str  # "float" (fp8) or "int" (int8)
    strategy: str  # "tensor" or "head" (compressed-tensors "attn_head")
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    source: str = ""
    meta: dict = field(default_factory=dict)
    rotation: str | None = None  # "hadamard" when calibrated on rotated K/V
    skip_layers: list | None = None  # layers the calibration chose to keep out of the main cache dtype
    k_clip: dict[int, float] = field(default_factory=dict)  # per-token modes: clipping ratio per layer
    v_clip: dict[int, float] = field(default_factory=dict)
    clip_dtype: str | None = None  # the per-token mode the ratios were chosen for
    k_mean: dict[int, torch.Tensor] = field(default_factory=dict)  # per-token modes: key basis per layer
    k_smooth: dict[int, torch.Tensor] = field(default_factory=dict)
    skip_dtype: str = "auto"  # what they hold: the model's dtype, or a per-token 8-bit dtype (SKIP_DTYPES)


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def _scheme(config: dict) -> tuple[dict | None, dict | None]:
    qc = config.get("quantization_config") or {}
    return qc.get("kv_cache_scheme"), config.get(QKV_SECTION)


def _tensor_files(path: Path, qkv_section: dict | None) -> list[Path]:
    if path.is_file():
        return [path]
    if qkv_section is not None:
        return [path / str(qkv_section.get("scales_file", QKV_SCALES_FILE))]
    return sorted(path.glob("*.safetensors"))


def _read_config(path: Path, flag: str) -> dict:
    """``config.json`` of a checkpoint directory ({} if there is none); errors name the flag and the file."""
    f = path / "config.json"
    if not path.is_dir() or not f.exists():
        return {}
    try:
        config = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read {f}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag} {path}: {f} must hold a JSON object, not {type(config).__name__}")
    qc = config.get("quantization_config")
    sections = (
        ("quantization_config", qc),
        (QKV_SECTION, config.get(QKV_SECTION)),
        ("kv_cache_scheme", qc.get("kv_cache_scheme") if isinstance(qc, dict) else None),
    )
    for key, value in sections:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{flag} {path}: '{key}' in {f} must be a JSON object, not {type(value).__name__}")
    return config


def _read_tensors(f: Path, flag: str, path: Path, want_meta: bool) -> tuple[dict, dict, dict, dict]:
    """K and V scale tensors of one safetensors file, its clipping ratios and key bases (``{"k": {layer: t},
    "v": ..., "mean": ..., "smooth": ...}``) and its metadata; a corrupt file names the flag and file."""
    k: dict[int, torch.Tensor] = {}
    v: dict[int, torch.Tensor] = {}
    clips: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "mean": {}, "smooth": {}}
    try:
        with safe_open(str(f), framework="pt") as fh:
            meta = dict(fh.metadata() or {}) if want_meta else {}
            for name in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                m = _NAME.search(name)
                if not m:
                    continue
                layer, which = int(m.group(1)), m.group(2)
                t = fh.get_tensor(name).to(torch.float32)
                if which in ("k_mean", "k_smooth"):
                    clips[which[2:]][layer] = t
                    continue
                t = t.reshape(-1)
                if which in ("k_clip", "v_clip"):
                    clips[which[0]][layer] = t
                if which in ("k_scale", "kv_scale"):
                    k[layer] = t
                if which in ("v_scale", "kv_scale"):
                    v[layer] = t
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, torch's dtype errors: all say "bad file"
        where = f"{flag} {path}" + ("" if f == path else f": {f}")
        raise ValueError(f"{where}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return k, v, clips, meta


def read_kv_scales(path: str | Path, flag: str = "--kv-scales") -> KVScales | None:
    """Scales stored in a checkpoint directory or a ``.safetensors`` file; ``None`` if it has none.

    ``flag`` says where ``path`` came from (``--kv-scales`` or the model argument), so that every error
    about a missing, unreadable or corrupt file names both the flag and the file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file or directory")
    config = _read_config(path, flag)
    scheme, section = _scheme(config)
    k: dict[int, torch.Tensor] = {}
    v: dict[int, torch.Tensor] = {}
    clips: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "mean": {}, "smooth": {}}
    file_meta: dict = {}
    for f in _tensor_files(path, section):
        # a bare scales file describes itself in its safetensors metadata
        fk, fv, fc, meta = _read_tensors(f, flag, path, want_meta=path.is_file())
        k.update(fk)
        v.update(fv)
        for side, found in fc.items():
            clips[side].update(found)
        file_meta = meta or file_meta
    if not k and not v and not clips["k"] and not clips["v"]:
        return None
    src = section or scheme or file_meta
    kind = src.get("type", "float")
    strategy = {"attn_head": "head"}.get(src.get("strategy", "tensor"), src.get("strategy", "tensor"))
    meta = dict(section or file_meta)
    rotation = src.get("rotation") or None
    rotation = None if rotation == "none" else rotation
    skip = src.get("skip_layers")
    if skip is not None and not isinstance(skip, (str, list)):
        raise ValueError(f"{flag} {path}: skip_layers must be a list or a string, not {type(skip).__name__}")
    if isinstance(skip, str):  # safetensors metadata holds strings: "3,7" / "sliding_window,3"
        skip = [x for x in skip.replace(",", " ").split()]
    skip = [int(x) if str(x).isdigit() else x for x in skip] if skip else None
    skip_dtype = str(src.get("skip_dtype") or "auto")  # a checkpoint without the key: the model's dtype
    from .layer_specs import check_skip_dtype

    try:
        check_skip_dtype(skip_dtype)
    except ValueError as e:
        raise ValueError(f"{flag} {path}: skip_dtype: {e}") from None
    k_clip, v_clip = ({i: _clip(t, flag, path) for i, t in clips[side].items()} for side in "kv")
    clip_dtype = src.get("kv_cache_dtype") if k_clip or v_clip else None
    return KVScales(
        kind,
        strategy,
        k,
        v,
        str(path),
        meta,
        rotation,
        skip,
        k_clip,
        v_clip,
        clip_dtype,
        k_mean=clips["mean"],
        k_smooth=clips["smooth"],
        skip_dtype=skip_dtype,
    )


def _clip(t: torch.Tensor, flag: str, path: Path) -> float:
    if t.numel() != 1 or not 0.0 < float(t) <= 1.0:
        raise ValueError(f"{flag} {path}: a clipping ratio must be one value in (0, 1], got {t.tolist()}")
    return float(t)


def _check(scales: KVScales, specs: list[LayerSpec]) -> None:
    n = len(specs)
    layers = sorted(set(scales.k) | set(scales.v))
    if layers != list(range(n)) or sorted(scales.k) != sorted(scales.v):
        raise ValueError(
            f"scales in {scales.source} cover layers {layers[:3]}..{layers[-1:]} "
            f"({len(layers)} layers, K {len(scales.k)} / V {len(scales.v)}) "
            f"but the model has {n} layers"
        )
    for spec in specs:
        for name, t in (("k_scale", scales.k[spec.layer_idx]), ("v_scale", scales.v[spec.layer_idx])):
            if scales.strategy == "channel":
                if t.numel() != spec.num_kv_heads * spec.head_dim:
                    raise ValueError(
                        f"layer {spec.layer_idx} {name} in {scales.source} has {t.numel()} values "
                        f"but per-channel scales need num_kv_heads x head_dim = "
                        f"{spec.num_kv_heads} x {spec.head_dim}"
                    )
            elif t.numel() not in (1, spec.num_kv_heads):
                raise ValueError(
                    f"layer {spec.layer_idx} {name} in {scales.source} has {t.numel()} values "
                    f"but the model has {spec.num_kv_heads} kv heads (expected 1 or {spec.num_kv_heads})"
                )
            bad = [x for x in t.tolist() if not (math.isfinite(x) and x > 0)]
            if bad:
                raise ValueError(
                    f"layer {spec.layer_idx} {name} in {scales.source} is {bad[0]}: scales must be finite and > 0"
                )


KV_ROTATION_CHOICES = ("auto", *ROTATIONS)


def _load(model_path: Path, kv_scales: str | None) -> KVScales | None:
    """Static scales (a file of clipping ratios alone has none)."""
    scales = read_kv_scales(kv_scales) if kv_scales is not None else read_kv_scales(model_path, "model")
    if scales is not None and not scales.k and not scales.v:
        scales = None
    if kv_scales is not None and scales is None:
        raise ValueError(f"--kv-scales {kv_scales} holds no k_scale/v_scale tensors")
    return scales


def _rotation(requested: str | None, scales: KVScales | None) -> str | None:
    """``--kv-rotation``: ``auto`` follows the scales; an explicit value must agree with them."""
    requested = requested or "auto"
    if requested not in KV_ROTATION_CHOICES:
        raise ValueError(f"--kv-rotation must be one of {', '.join(KV_ROTATION_CHOICES)}, got {requested!r}")
    if scales is None:
        return None if requested in ("auto", "none") else requested
    if requested == "auto":
        return scales.rotation
    want = None if requested == "none" else requested
    if want != scales.rotation:
        have = scales.rotation or "none"
        raise ValueError(
            f"scales in {scales.source} were calibrated with --kv-rotation {have} "
            f"({scales.strategy} strategy) but --kv-rotation {requested} was asked for: scales only fit "
            f"the basis they were measured in; drop the flag or recalibrate with "
            f"`qkv calibrate --kv-rotation {requested}`"
        )
    return want


def resolve_kv_cache(
    layout: list[dict],
    model_path: Path,
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    kv_scales: str | None = None,
    skip_layers=None,
    rotation: str | None = "auto",
    skip_dtype: str | None = None,
) -> tuple[
    list[LayerSpec], dict[int, tuple[torch.Tensor, torch.Tensor]], dict[int, tuple[float, float]], dict[int, KeyBasis]
]:
    """Every layer's cache spec, static scales and (per-token modes) clipping ratios and key bases, from the flags
    and what the checkpoint carries.

    A statically scaled dtype reads the checkpoint's scales first, because they
    decide the defaults: ``--kv-rotation auto`` takes their rotation and, when no
    ``--kv-cache-dtype-skip-layers`` is given, their auto-skip layers apply, and without
    ``--kv-cache-dtype-skip-dtype``, the dtype auto-skip chose for them.
    """
    from .kernels.quant import resolve_cache_dtype
    from .layer_specs import build_layer_specs

    dt = resolve_cache_dtype(kv_cache_dtype, model_dtype)
    scales = None
    if dt.quantized and not dt.dynamic:
        scales = _load(model_path, kv_scales)
    elif dt.packed:  # only the 4-bit per-token modes are calibrated (clipping ratios); the others read nothing
        scales = _load_clips(model_path, kv_scales, dt.name)
    rot = _rotation(rotation, scales)
    if skip_dtype is None:  # no flag: what the checkpoint's auto-skip chose
        skip_dtype = scales.skip_dtype if scales is not None else "auto"
    if skip_layers is None and scales is not None and scales.skip_layers:
        skip_layers = scales.skip_layers
        logger.info(
            "keeping layers %s in %s, as chosen at calibration (%s)",
            skip_layers,
            "the model's dtype" if skip_dtype == "auto" else skip_dtype,
            scales.source,
        )
    specs = build_layer_specs(layout, kv_cache_dtype, model_dtype, skip_layers, rot, skip_dtype)
    if dt.dynamic:
        return specs, {}, _clips(specs, scales), _bases(specs, scales)
    return specs, resolve_scales(specs, model_path, kv_scales, kv_cache_dtype, scales), {}, {}


def _load_clips(model_path: Path, kv_scales: str | None, name: str) -> KVScales | None:
    """The clipping ratios chosen for per-token mode ``name``: ``--kv-scales`` must hold them; a model directory
    may (ratios for another mode, or static scales, are not for this cache and are left alone)."""
    scales = read_kv_scales(kv_scales) if kv_scales is not None else read_kv_scales(model_path, "model")
    found = scales is not None and scales.clip_dtype == name
    if kv_scales is not None and not found:
        have = f"ratios for {scales.clip_dtype}" if scales is not None and scales.clip_dtype else "no clipping ratios"
        raise ValueError(
            f"--kv-scales {kv_scales} holds {have}; --kv-cache-dtype {name} computes its scales per token and reads "
            f"only clipping ratios calibrated for it (`qkv calibrate --kv-cache-dtype {name}`)"
        )
    if found and scales is not None and scales.meta.get("int4_grid") != INT4_GRID:
        raise ValueError(
            f"{scales.source}: its clipping ratios for {name} were chosen for qkv's earlier symmetric int4 grid "
            f"([-7, 7]; the checkpoint has no int4_grid: {INT4_GRID}); the cache now uses the signed grid [-8, 7], "
            f"so recalibrate: `qkv calibrate --kv-cache-dtype {name}`"
        )
    return scales if found else None


def _clips(specs: list[LayerSpec], scales: KVScales | None) -> dict[int, tuple[float, float]]:
    """``{layer: (k_clip, v_clip)}`` for the per-token layers; every layer of the model must have both."""
    if scales is None:
        return {}
    _cover(specs, scales.source, "clipping ratios", "K / V", scales.k_clip, scales.v_clip)
    return {
        s.layer_idx: (scales.k_clip[s.layer_idx], scales.v_clip[s.layer_idx]) for s in specs if _calibrated(s, scales)
    }


def _calibrated(spec: LayerSpec, scales: KVScales) -> bool:
    """Whether a layer holds the per-token mode its ratios and key basis were chosen for: not a kept layer, BF16
    or a per-token 8-bit one (dynamic too), which auto-skip measured without them."""
    return spec.dtype.name == scales.clip_dtype


def _cover(specs: list[LayerSpec], source: str, what: str, sides: str, a: dict, b: dict) -> None:
    """Per-layer tensors of a per-token calibration must cover every layer of the model, on both sides."""
    n = len(specs)
    if sorted(a) != list(range(n)) or sorted(b) != list(range(n)):
        raise ValueError(f"{what} in {source} cover {len(a)} / {len(b)} layers ({sides}) but the model has {n} layers")


def _bases(specs: list[LayerSpec], scales: KVScales | None) -> dict[int, KeyBasis]:
    """``{layer: KeyBasis}`` for the per-token layers, when the calibration chose a basis: every layer of the
    model has both tensors, of its ``[Hkv, D]`` shape."""
    if scales is None or not (scales.k_mean or scales.k_smooth):
        return {}
    _cover(specs, scales.source, "key bases", "k_mean / k_smooth", scales.k_mean, scales.k_smooth)
    out = {}
    for s in specs:
        i, shape = s.layer_idx, (s.num_kv_heads, s.head_dim)
        for name, t in (("k_mean", scales.k_mean[i]), ("k_smooth", scales.k_smooth[i])):
            if tuple(t.shape) != shape:
                raise ValueError(f"{scales.source}: layer {i}'s {name} is {tuple(t.shape)}, the model's K is {shape}")
        try:
            basis = KeyBasis(scales.k_mean[i], scales.k_smooth[i])
        except ValueError as e:
            raise ValueError(f"{scales.source}: layer {i}: {e}") from None
        if _calibrated(s, scales):
            out[i] = basis
    return out


def resolve_scales(
    specs: list[LayerSpec], model_path: Path, kv_scales: str | None, kv_cache_dtype: str, scales: KVScales | None = None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Static scales per quantized layer, as ``{layer_idx: (k_scale, v_scale)}`` (fp32 ``[1]``, ``[Hkv]``
    or per channel ``[Hkv, D]``).

    ``--kv-scales`` wins over scales the model checkpoint carries. Uncalibrated
    fp8 falls back to scale 1.0 with a warning, as vLLM does; static int8 has
    no sensible default, so it is an error that says how to calibrate.
    """
    static = [s for s in specs if s.dtype.quantized and not s.dtype.dynamic]
    if not static:
        return {}
    want = static[0].dtype.kind
    if scales is None:
        scales = _load(model_path, kv_scales)
    if scales is None:
        if want == "int":
            raise ValueError(
                f"--kv-cache-dtype {kv_cache_dtype} needs calibrated scales: run "
                f"`qkv calibrate MODEL --kv-cache-dtype int8 -o OUT` and pass OUT as the model or "
                f"--kv-scales OUT, or use the dynamic int8_per_token_head mode"
            )
        _warn_once(
            f"Using KV cache scaling factor 1.0 for {kv_cache_dtype}: the checkpoint has no calibrated "
            f"k_scale/v_scale. This may hurt accuracy; calibrate with `qkv calibrate`."
        )
        return {s.layer_idx: (torch.ones(1), torch.ones(1)) for s in static}
    if scales.kind != want:
        have = {"float": "fp8", "int": "int8"}.get(scales.kind, scales.kind)
        raise ValueError(
            f"scales in {scales.source} were calibrated for {have} but --kv-cache-dtype is "
            f"{kv_cache_dtype}; recalibrate with `qkv calibrate --kv-cache-dtype "
            f"{'int8' if want == 'int' else 'fp8'}`"
        )
    _check(scales, specs)
    if scales.strategy == "channel":
        return {
            s.layer_idx: (
                scales.k[s.layer_idx].reshape(s.num_kv_heads, s.head_dim),
                scales.v[s.layer_idx].reshape(s.num_kv_heads, s.head_dim),
            )
            for s in static
        }
    return {s.layer_idx: (scales.k[s.layer_idx], scales.v[s.layer_idx]) for s in static}
