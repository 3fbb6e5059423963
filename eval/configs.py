"""Evaluation configurations: the ``--configs`` grammar and what each one hands the engine.

Grammar of one configuration (configurations are separated by commas)::

    DTYPE[:SCALES_DIR][+rot=ROTATION][+skip=LAYERS]

* ``DTYPE`` is any ``--kv-cache-dtype`` of the engine: ``bf16``/``bfloat16``/``auto``,
  ``fp8`` (= ``fp8_e4m3``), ``fp8_e5m2``, ``int8`` (needs scales),
  ``fp8_per_token_head``, ``int8_per_token_head``, ``int4_per_token_head``, ``k8v4_per_token_head``.
* ``SCALES_DIR`` is a calibrated checkpoint directory or scales file
  (``qkv calibrate -o``), passed to the engine as ``kv_scales``: static scales, or for the 4-bit
  per-token modes their clipping ratios.
* ``LAYERS`` are ``sliding_window`` and/or layer indices separated by ``/`` or
  ``;`` (a comma would end the configuration), e.g. ``+skip=sliding_window/0/17``;
  ``+skip=none`` quantizes every layer even when the checkpoint records auto-skip layers.
* ``ROTATION`` is ``hadamard`` or ``none`` (qkv's ``--kv-rotation``); without it the
  engine follows the scales (``auto``), so a rotated checkpoint needs no modifier.

``NAME=URL`` is an OpenAI-compatible completions server instead (``vllm serve``, ``qkv serve``; URL is its
``/v1`` base, e.g. ``vllm-fp8=http://127.0.0.1:8001/v1``), scored through the API (eval/server.py).

The first configuration is the baseline. Labels are the configuration strings
with the scales directory shortened to its last path component, so they stay
readable in tables and figures while ``spec`` keeps the full string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from qkv.kernels.quant import CACHE_DTYPE_NAMES, resolve_cache_dtype

__all__ = ["EvalConfig", "ServerConfig", "parse_config", "parse_configs", "ConfigError"]

_MODIFIER = re.compile(r"\+(skip|rot)=([^+]*)")


def _cd(name: str):
    return resolve_cache_dtype("bfloat16" if name == "auto" else name)


class ConfigError(ValueError):
    """A configuration string that cannot be parsed or used."""


@dataclass(frozen=True)
class EvalConfig:
    spec: str  # the string as given
    kv_cache_dtype: str  # canonical engine name (fp8 -> fp8_e4m3, bf16 -> bfloat16)
    scales: str | None = None  # kv_scales for the engine
    skip_layers: tuple | None = None  # ("sliding_window", 3, ...); () = explicitly none; None = engine default
    rotation: str = "auto"  # engine kv_rotation: auto (follow the scales) | none | hadamard

    @property
    def label(self) -> str:
        out = {"bfloat16": "bf16", "fp8_e4m3": "fp8"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.scales:
            p = Path(self.scales)
            out += ":" + (p.stem if p.suffix == ".safetensors" else p.name)
        if self.rotation != "auto":
            out += "+rot=" + self.rotation
        if self.skip_layers is not None:
            out += "+skip=" + ("/".join(str(s) for s in self.skip_layers) or "none")
        return out

    @property
    def quantized(self) -> bool:
        return _cd(self.kv_cache_dtype).quantized

    @property
    def dynamic(self) -> bool:
        return _cd(self.kv_cache_dtype).dynamic

    def engine_kwargs(self) -> dict:
        return {
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_scales": self.scales,
            "kv_cache_dtype_skip_layers": None if self.skip_layers is None else list(self.skip_layers),
            "kv_rotation": self.rotation,
        }

    def to_json(self) -> dict:
        return {
            "spec": self.spec,
            "label": self.label,
            "kv_cache_dtype": self.kv_cache_dtype,
            "scales": self.scales,
            "skip_layers": list(self.skip_layers or []),
            "rotation": self.rotation,
        }


@dataclass(frozen=True)
class ServerConfig:
    """A completions server to score through (``NAME=URL``); it knows nothing of qkv's cache."""

    spec: str
    label: str
    url: str
    quantized = False  # not known here: the server's own flags say

    def to_json(self) -> dict:
        return {"spec": self.spec, "label": self.label, "server": self.url}


def _server(spec: str) -> ServerConfig | None:
    name, sep, url = spec.partition("=")
    if not sep or "://" not in url:
        return None
    if not re.fullmatch(r"[\w.@-]+", name.strip()):
        raise ConfigError(f"server configuration {spec!r}: NAME (before '=') must be letters, digits or . _ @ -")
    if not re.match(r"https?://[^/\s]+", url.strip()):
        raise ConfigError(f"server configuration {spec!r}: URL must be http(s)://HOST[:PORT]/v1")
    return ServerConfig(spec.strip(), name.strip(), url.strip())


def _dtype(name: str, spec: str) -> str:
    if name == "auto":
        return "auto"  # the model dtype
    try:
        return resolve_cache_dtype(name).name
    except ValueError:
        raise ConfigError(
            f"unknown configuration {spec!r}: {name!r} is not a kv-cache dtype; "
            f"use DTYPE[:SCALES_DIR][+skip=LAYERS] with DTYPE one of "
            f"bf16, {', '.join(n for n in CACHE_DTYPE_NAMES if n != 'auto')}"
        ) from None


def _layers(text: str, spec: str) -> tuple:
    if text.strip() == "none":
        return ()
    parts = [p.strip() for p in re.split(r"[/;]", text) if p.strip()]
    if not parts:
        raise ConfigError(
            f"configuration {spec!r}: '+skip=' needs layers (sliding_window and/or indices separated by '/' or ';')"
        )
    out: list = []
    for p in parts:
        if p == "sliding_window":
            out.append(p)
        elif re.fullmatch(r"\d+", p):
            out.append(int(p))
        else:
            raise ConfigError(f"configuration {spec!r}: skip layer {p!r} is neither 'sliding_window' nor a layer index")
    return tuple(dict.fromkeys(out))


def parse_config(spec: str) -> EvalConfig | ServerConfig:
    """``"fp8:calib/fp8-head+skip=sliding_window"`` -> :class:`EvalConfig`; ``"NAME=URL"`` -> :class:`ServerConfig`."""
    text = spec.strip()
    if not text:
        raise ConfigError("empty configuration in --configs")
    server = _server(text)
    if server is not None:
        return server
    skip: tuple | None = None
    rotation = "auto"
    head, _, mods = text.partition("+")
    mods = "+" + mods if mods else ""
    found = _MODIFIER.findall(mods)
    if "".join(f"+{k}={v}" for k, v in found) != mods:
        raise ConfigError(f"unknown configuration {spec!r}: the modifiers are '+rot=hadamard|none' and '+skip=LAYERS'")
    for key, val in found:
        if key == "skip":
            skip = _layers(val, spec)
        elif val.strip() in ("hadamard", "none"):
            rotation = val.strip()
        else:
            raise ConfigError(f"configuration {spec!r}: rotation {val!r} is neither 'hadamard' nor 'none'")
    text = head
    name, _, scales = text.partition(":")
    dtype = _dtype(name.strip().lower(), spec)
    scales_dir = scales.strip() or None
    if scales_dir is not None:
        if not _cd(dtype).quantized or (_cd(dtype).dynamic and not _cd(dtype).packed):
            raise ConfigError(f"configuration {spec!r}: {dtype} takes no static scales or clipping ratios")
        if not Path(scales_dir).exists():
            raise ConfigError(f"configuration {spec!r}: scales {scales_dir} do not exist")
    if skip is not None and not _cd(dtype).quantized:
        raise ConfigError(f"configuration {spec!r}: skipping layers only makes sense for a quantized cache")
    return EvalConfig(spec.strip(), dtype, scales_dir, skip, rotation)


def parse_configs(text: str | list[str]) -> list[EvalConfig | ServerConfig]:
    """Comma-separated configurations; the first is the baseline. Labels must be unique."""
    specs = text.split(",") if isinstance(text, str) else list(text)
    configs = [parse_config(s) for s in specs]
    if not configs:
        raise ConfigError("--configs is empty")
    seen: dict[str, str] = {}
    for c in configs:
        if c.label in seen:
            raise ConfigError(
                f"configurations {seen[c.label]!r} and {c.spec!r} have the same label "
                f"{c.label!r}; give the scales directories different names"
            )
        seen[c.label] = c.spec
    return configs
