"""What a calibration run records: ``calibration.json`` and the summary table printed at the end."""

from __future__ import annotations

import importlib.metadata as md
import platform

from .run import Calibration

__all__ = ["calibration_record", "summary_table", "versions"]


def versions() -> dict:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("qkv", "torch", "transformers", "datasets", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _list(t) -> list[float]:
    return [float(x) for x in t.reshape(-1).tolist()]


def calibration_record(cal: Calibration, output: dict | None = None) -> dict:
    """The calibration.json document: what was run, and a per-layer table of amax, scale and clip rate."""
    dt = cal.kv_dtype
    info = dict(cal.samples_info)
    return {
        "qkv_calibration_version": 2,
        "model": cal.model,
        "model_path": str(cal.model_path),
        "model_dtype": cal.model_dtype,
        "data_free": info.get("source") == "self-generated",
        "dataset": info,
        "num_samples": cal.num_samples,
        "seq_len": info.get("seq_len"),
        "tokens": cal.num_tokens,
        "seed": cal.seed,
        "observer": cal.observer.get("observer"),
        "percentile": cal.observer.get("percentile"),
        "observer_params": cal.observer,
        "kv_cache_dtype": dt.name,
        "qmax": dt.qmax,
        "strategy": cal.strategy,
        "rotation": cal.rotation or "none",
        "skip_layers": list(cal.skip_layers or []),
        "skip_dtype": cal.skip_dtype,
        "auto_skip": cal.sensitivity,
        "fold": cal.fold,
        "scale_convention": scale_convention(cal),
        "observed": "K after RoPE (and k_norm), V as projected: the tensors the paged cache stores",
        "versions": versions(),
        "wall_time_s": round(cal.wall_time_s, 3),
        "observe_time_s": round(cal.observe_time_s, 3),
        "date": cal.date,
        "output": output or {},
        "layers": [
            {
                "layer": r.layer,
                "num_kv_heads": r.num_kv_heads,
                "k": {
                    "amax": _list(r.k_amax),
                    "observed_amax": _list(r.k_observed_amax),
                    "scale": _list(r.k_scale),
                    "clip_rate": r.k_clip_rate,
                },
                "v": {
                    "amax": _list(r.v_amax),
                    "observed_amax": _list(r.v_observed_amax),
                    "scale": _list(r.v_scale),
                    "clip_rate": r.v_clip_rate,
                },
            }
            for r in cal.layers
        ],
        "clips": [
            {
                "layer": c.layer,
                "k": {"clip": c.k_clip, "mse": c.k_mse, "mse_unclipped": c.k_mse_unclipped},
                "v": {"clip": c.v_clip, "mse": c.v_mse, "mse_unclipped": c.v_mse_unclipped},
            }
            for c in cal.clips or []
        ],
        "key_basis": [
            {
                "layer": i,
                "k_mean_abs_max": float(b.mean.abs().max()),
                "k_smooth_min": float(b.smooth.min()),
                "k_smooth_max": float(b.smooth.max()),
            }
            for i, b in sorted((cal.bases or {}).items())
        ],
    }


def scale_convention(cal: Calibration) -> str:
    """How the stored numbers make a cache scale, in words (checkpoint metadata and calibration.json)."""
    dt = cal.kv_dtype
    if cal.clips is not None:
        qmax = "/".join(f"{dt.side_qmax(kv):g}" for kv in (0, 1)) if dt.side_qmax(0) != dt.side_qmax(1) else None
        q = f"{qmax} (K/V)" if qmax else f"{dt.side_qmax(0):g}"
        basis = "; on centred, smoothed K (k_mean, k_smooth)" if cal.bases else ""
        signed = "; an int4 side's scale is negative where its largest-magnitude value is positive (codes [-8, 7])"
        return f"q = x / scale; |scale| = amax(token, head) / {q} * clip (clip per layer and side){signed}{basis}"
    return f"q = x / scale; scale = amax / {dt.qmax:g}"


def _fmt(t) -> str:
    vals = t.reshape(-1).tolist()
    if len(vals) == 1:
        return f"{vals[0]:.4g}"
    return f"{min(vals):.3g}..{max(vals):.3g}"


def summary_table(cal: Calibration) -> str:
    """Plain-text table, one row per layer (per-head values shown as min..max)."""
    if cal.clips is not None:
        return _clip_table(cal)
    head = f"{'layer':>5}  {'K amax':>15} {'K scale':>17} {'K clip':>8}  {'V amax':>15} {'V scale':>17} {'V clip':>8}"
    lines = [head, "-" * len(head)]
    for r in cal.layers:
        lines.append(
            f"{r.layer:>5}  {_fmt(r.k_amax):>15} {_fmt(r.k_scale):>17} {100 * r.k_clip_rate:>7.3f}%  "
            f"{_fmt(r.v_amax):>15} {_fmt(r.v_scale):>17} {100 * r.v_clip_rate:>7.3f}%"
        )
    return "\n".join([*lines, _footer(cal)])


def _clip_table(cal: Calibration) -> str:
    head = f"{'layer':>5}  {'K clip':>7} {'K MSE vs 1.0':>13}  {'V clip':>7} {'V MSE vs 1.0':>13}"
    lines = [head, "-" * len(head)]
    for c in cal.clips or []:
        k = c.k_mse / c.k_mse_unclipped if c.k_mse_unclipped else 1.0
        v = c.v_mse / c.v_mse_unclipped if c.v_mse_unclipped else 1.0
        lines.append(f"{c.layer:>5}  {c.k_clip:>7.3f} {k:>12.3f}x  {c.v_clip:>7.3f} {v:>12.3f}x")
    return "\n".join([*lines, _footer(cal)])


def _footer(cal: Calibration) -> str:
    obs = cal.observer.get("observer")
    if cal.observer.get("percentile") is not None:
        obs += f" (P{cal.observer['percentile']:g})"
    src = cal.samples_info.get("source", "?")
    rot = f" / rotation {cal.rotation}" if cal.rotation else ""
    return (
        f"{cal.model}: {cal.kv_dtype.name} / {cal.strategy}{rot} / {obs}; {cal.num_samples} samples, "
        f"{cal.num_tokens:,} tokens ({src}); {cal.wall_time_s:.1f} s"
    )
