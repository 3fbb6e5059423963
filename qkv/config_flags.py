"""Command-line flags generated from typed configs (:mod:`qkv.options`), so that every subcommand (generate,
bench, serve, eval, calibrate) shows the same names, types, choices, defaults and help as the Python API,
written once: in the field's :func:`~qkv.options.option`. It lives in the core so that the server and the
tools above need not import ``qkv.cli`` for it.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from .config import EngineConfig

__all__ = ["ENGINE_FLAG_FIELDS", "add_config_args", "add_engine_args", "config_kwargs", "engine_kwargs", "flag_name"]

# seed is the driver's, not the engine's: generate's --seed seeds sampling, eval and bench seed their own draws.
_NOT_FLAGS = frozenset({"seed"})
ENGINE_FLAG_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(EngineConfig) if f.name not in _NOT_FLAGS)
# Names kept from before the flags were generated (each sets the field to False).
_NEGATIVE_ALIASES = {"enable_prefix_caching": "--no-prefix-caching"}


def flag_name(name: str) -> str:
    """``kv_cache_dtype`` -> ``--kv-cache-dtype`` (vLLM's spelling)."""
    return "--" + name.replace("_", "-")


def _scalar_type(tp: Any) -> tuple[type, bool]:
    """The type argparse converts to (one item's, for a list), and whether the field is a list.

    A union holding ``str`` stays a string (``"2GiB"``, ``"sliding_window"``): the config parses it.
    """
    args = set(typing.get_args(tp)) if typing.get_origin(tp) in (typing.Union, types.UnionType) else {tp}
    args.discard(type(None))
    lists = [a for a in args if typing.get_origin(a) in (list, tuple)]
    plain = {a for a in args if typing.get_origin(a) not in (list, tuple)}
    if lists:
        item = typing.get_args(lists[0])[0]
        item_args = set(typing.get_args(item)) if typing.get_origin(item) in (typing.Union, types.UnionType) else {item}
        return (str if str in item_args or str in plain else next(iter(item_args))), True
    if str in plain:
        return str, False
    if plain == {int, float}:  # a size in GiB: 4 or 0.5
        return float, False
    (only,) = plain
    return only, False


def _separated(conv: type, sep: str, name: str):
    def parse(text: str) -> list:
        if text.strip().lower() in ("", "none"):
            return []
        try:
            return [conv(x.strip()) for x in text.split(sep) if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag_name(name)}: expected {sep!r}-separated values, got {text!r}"
            ) from None

    return parse


def _add_field(group: argparse._ActionsContainer, f: Field, tp: Any, default: Any) -> None:
    meta = f.metadata
    help_text = meta["help"]() if callable(meta["help"]) else meta["help"]  # a function: its module is the source
    if f.default is MISSING and f.default_factory is MISSING and default is MISSING:  # the model: positional
        group.add_argument(f.name, help=help_text)
        return
    names = [meta.get("flag") or flag_name(f.name)] + ([meta["short"]] if meta.get("short") else [])
    common = dict(dest=f.name, default=default)
    if meta.get("required"):
        common = dict(dest=f.name, required=True)
    if tp is bool:
        group.add_argument(
            *names, action=argparse.BooleanOptionalAction, help=help_text + " (default: %(default)s)", **common
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
    if default not in (None, MISSING) and "default" not in help_text and not meta.get("required"):
        shown = meta["sep"].join(map(str, default)) if is_list and meta.get("sep") else "%(default)s"
        help_text += f" (default: {shown})"
    kwargs: dict[str, Any] = dict(help=help_text, **common)
    if is_list and meta.get("sep"):
        kwargs["type"] = _separated(conv, meta["sep"], f.name)
    elif is_list and meta.get("append"):
        kwargs.update(type=conv, action="append", choices=list(choices) if choices is not None else None)
    elif is_list:
        kwargs.update(type=conv, nargs="+", choices=list(choices) if choices is not None else None)
    else:
        kwargs.update(type=conv, choices=list(choices) if choices is not None else None)
    group.add_argument(*names, **kwargs)


def add_config_args(
    parser: argparse._ActionsContainer,
    cls: type,
    names: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of the dataclass ``cls``'s option fields ``names`` (default: every one the command line
    takes) to ``parser``. ``defaults`` overrides a field's default where a tool means another one (eval
    scores in bfloat16 with a smaller cache); everything else about the flag still comes from the field."""
    by_name = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    if names is None:
        names = [n for n, f in by_name.items() if "help" in f.metadata and f.metadata.get("cli", True)]
    for name in names:
        f = by_name[name]
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        _add_field(parser, f, hints[name], defaults.get(name, default))


def config_kwargs(cls: type, args: argparse.Namespace, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of ``cls`` among parsed ``args``, as keywords (a list flag given as ``none`` is ``[]``)."""
    skip = set(exclude)
    return {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in skip and hasattr(args, f.name)}


def add_engine_args(
    parser: argparse._ActionsContainer,
    names: Iterable[str] = ENGINE_FLAG_FIELDS,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of EngineConfig's fields ``names`` (``model`` positional) to ``parser``."""
    add_config_args(parser, EngineConfig, names, defaults)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options among parsed ``args`` (without the model), as EngineConfig keywords."""
    return {k: getattr(args, k) for k in ENGINE_FLAG_FIELDS if k != "model" and hasattr(args, k)}
