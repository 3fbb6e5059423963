"""Command-line flags generated from :class:`~qkv.config.EngineConfig`, so that every subcommand (generate,
bench, serve, eval, calibrate) shows the same names, types, choices, defaults and help, written once: in the
field's :func:`~qkv.config.option`. It lives in the core so that the server and the tools above need not
import ``qkv.cli`` for it.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from .config import EngineConfig

__all__ = ["ENGINE_FLAG_FIELDS", "add_engine_args", "engine_kwargs", "flag_name"]

# seed is the driver's, not the engine's: generate's --seed seeds sampling, eval and bench seed their own draws.
_NOT_FLAGS = frozenset({"seed"})
ENGINE_FLAG_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(EngineConfig) if f.name not in _NOT_FLAGS)
# Names kept from before the flags were generated (each sets the field to False).
_NEGATIVE_ALIASES = {"enable_prefix_caching": "--no-prefix-caching"}


def flag_name(name: str) -> str:
    """``kv_cache_dtype`` -> ``--kv-cache-dtype`` (vLLM's spelling)."""
    return "--" + name.replace("_", "-")


def _scalar_type(tp: Any) -> tuple[type, bool]:
    """The type argparse converts to, and whether the flag takes a list (``nargs='+'``).

    A union holding ``str`` stays a string (``"2GiB"``, ``"sliding_window"``): EngineConfig parses it.
    """
    args = set(typing.get_args(tp)) if typing.get_origin(tp) in (typing.Union, types.UnionType) else {tp}
    args.discard(type(None))
    is_list = any(typing.get_origin(a) is list for a in args)
    plain = {a for a in args if typing.get_origin(a) is not list}
    if str in plain or is_list:
        return str, is_list
    if plain == {int, float}:  # a size in GiB: 4 or 0.5
        return float, False
    (only,) = plain
    return only, False


def _add_field(group: argparse._ActionsContainer, f: Field, tp: Any, default: Any) -> None:
    meta = f.metadata
    help_text = meta["help"]
    if f.default is MISSING and default is MISSING:  # the model: positional
        group.add_argument(f.name, help=help_text)
        return
    if tp is bool:
        group.add_argument(
            flag_name(f.name),
            action=argparse.BooleanOptionalAction,
            default=default,
            help=help_text + " (default: %(default)s)",
        )
        if f.name in _NEGATIVE_ALIASES:
            group.add_argument(
                _NEGATIVE_ALIASES[f.name],
                dest=f.name,
                action="store_false",
                help=f"same as --no-{f.name.replace('_', '-')}",
            )
        return
    conv, is_list = _scalar_type(tp)
    choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
    if default is not None and "default" not in help_text:
        help_text += " (default: %(default)s)"
    group.add_argument(
        flag_name(f.name),
        type=conv,
        default=default,
        help=help_text,
        choices=list(choices) if choices is not None else None,
        nargs="+" if is_list else None,
    )


def add_engine_args(
    parser: argparse._ActionsContainer,
    names: Iterable[str] = ENGINE_FLAG_FIELDS,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of EngineConfig's fields ``names`` (``model`` positional) to ``parser``.

    ``defaults`` overrides a field's default where a tool means another one (eval scores in bfloat16
    with a smaller cache); everything else about the flag still comes from the field.
    """
    by_name = {f.name: f for f in fields(EngineConfig)}
    hints = typing.get_type_hints(EngineConfig)
    defaults = defaults or {}
    for name in names:
        f = by_name[name]
        _add_field(parser, f, hints[name], defaults.get(name, f.default))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options among parsed ``args`` (without the model), as EngineConfig keywords."""
    return {k: getattr(args, k) for k in ENGINE_FLAG_FIELDS if k != "model" and hasattr(args, k)}
