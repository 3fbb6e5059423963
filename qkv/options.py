"""Typed configuration fields, written once: the default, the help, the choices and the checks of an option.

Every command's configuration is a dataclass whose fields are :func:`option`\\ s: the engine's
(:class:`~qkv.config.EngineConfig`), the sampling parameters, and each tool's own (serve, generate, bench,
calibrate, eval). :func:`validate_options` checks an instance field by field, and
:mod:`qkv.config_flags` turns the same fields into command-line flags, so a default or a help text is
never written twice and a flag cannot drift from the Python API.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, field, fields
from typing import Any

__all__ = ["Checked", "option", "option_default", "validate_options"]


def option(
    default: Any = MISSING,
    help: str | Callable[[], str] = "",
    *,
    choices=None,
    ge: int | float | None = None,
    check=None,
    default_factory: Any = MISSING,
    flag: str | None = None,
    short: str | None = None,
    sep: str | None = None,
    append: bool = False,
    required: bool = False,
    cli: bool = True,
):
    """A config field with what validation and a command-line flag need.

    ``choices`` (and ``help``) is a tuple (a string), or a function giving one, so that the owning module stays
    the one source;
    ``ge`` an inclusive lower bound; ``check(value)`` raises ``ValueError("must ...")`` (the field name goes
    in front) or the owning module's own message (which then follows the field name and a colon).
    For the flag: ``flag`` replaces the ``--field-name`` spelling, ``short`` adds one (``-o``), ``sep`` parses a
    list from one separated string (``--batch-sizes 1,16``; without it a list takes several words),
    ``append`` makes a repeatable flag, ``required`` a flag that must be given, and ``cli=False`` keeps a
    field out of the command line.
    """
    meta = {
        "help": help,
        "choices": choices,
        "ge": ge,
        "check": check,
        "flag": flag,
        "short": short,
        "sep": sep,
        "append": append,
        "required": required,
        "cli": cli,
    }
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


class Checked:
    """Base of an options dataclass that is validated (:func:`validate_options`) as soon as it is built."""

    def __post_init__(self) -> None:
        validate_options(self)


def option_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``cls`` (its factory's value for a list)."""
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


def validate_options(obj: Any) -> None:
    """Raise ``ValueError`` naming the first field of ``obj`` whose type, range or value is wrong."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        if "help" not in f.metadata:  # a plain field, not an option
            continue
        value, meta = getattr(obj, f.name), f.metadata
        if not _matches(value, hints[f.name]):
            raise ValueError(f"{f.name} must be {_describe(hints[f.name])}, got {value!r}")
        if value is None:
            continue
        choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
        if choices is not None:
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v not in choices:
                    raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {v!r}")
        if meta["ge"] is not None and value < meta["ge"]:
            raise ValueError(f"{f.name} must be >= {meta['ge']}, got {value}")
        if meta["check"] is not None:
            try:
                meta["check"](value)
            except ValueError as e:
                reason = str(e)
                raise ValueError(f"{f.name} {reason}" if reason.startswith("must") else f"{f.name}: {reason}") from None


def _matches(value, tp) -> bool:
    """``isinstance`` for the annotations configs use (unions, ``list[X]``, ``tuple[X, ...]``); a bool is not an
    int, an int is a float."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, t) for t in typing.get_args(tp))
    if origin in (list, tuple):
        item = typing.get_args(tp)[0]
        return isinstance(value, origin) and all(_matches(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(t) for t in typing.get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "None"}
    return names.get(tp, tp.__name__)
