"""The engine flags of every subcommand come from EngineConfig: same names, same defaults, written once."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest

from qkv.cli import build_parser
from qkv.config import EngineConfig
from qkv.config_flags import ENGINE_FLAG_FIELDS, engine_kwargs, flag_name
from qkv.eval.bench import BENCH_ENGINE_FIELDS
from qkv.eval.cli import EVAL_ENGINE_FIELDS
from qkv.eval.run import EvalArgs

REQUIRED = {"generate": ["--prompt", "hi"], "eval": ["--report", "r"], "calibrate": ["-o", "out"]}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _parse(command: str, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args([command, "m", *REQUIRED.get(command, []), *extra])


def _engine_flags(command: str) -> dict[str, tuple[str, ...]]:
    """dest -> option strings, for the engine fields a subcommand exposes."""
    out: dict[str, tuple[str, ...]] = {}
    for a in _subparser(command)._actions:
        if a.dest in ENGINE_FLAG_FIELDS:
            out[a.dest] = out.get(a.dest, ()) + tuple(a.option_strings or [a.dest])
    return out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_parser_defaults_are_engine_config_defaults(command):
    args = _parse(command)
    for f in fields(EngineConfig):
        if f.name in ENGINE_FLAG_FIELDS and f.default is not MISSING:
            assert getattr(args, f.name) == f.default, f.name
    # and the parsed flags build the default configuration
    assert EngineConfig(model="m", **engine_kwargs(args)) == EngineConfig(model="m")


def test_bench_names_its_dtype_list_apart_and_sets_prefix_caching_by_mode():
    """bench's dtypes are a list under a name of their own; the engine's --kv-cache-dtype and prefix-caching
    flags are absent there rather than silently overridden."""
    args, plain = _parse("bench"), _parse("generate")
    assert not hasattr(args, "kv_cache_dtype") and not hasattr(args, "enable_prefix_caching")
    assert args.kv_cache_dtypes == ["bfloat16", "fp8"]
    assert _parse("bench", "--kv-cache-dtypes", "bf16,fp8:dir,int8_per_token_head").kv_cache_dtypes == [
        "bf16",
        "fp8:dir",
        "int8_per_token_head",
    ]
    assert {k for k in BENCH_ENGINE_FIELDS if getattr(args, k) != getattr(plain, k)} == set()


def test_every_engine_command_exposes_the_same_engine_flags():
    want = _engine_flags("generate")
    assert set(want) == set(ENGINE_FLAG_FIELDS)
    for command in ("generate", "serve"):
        assert _engine_flags(command) == want, command
    assert _engine_flags("bench") == {k: want[k] for k in BENCH_ENGINE_FIELDS}
    for name, opts in want.items():
        assert name == "model" or flag_name(name) in opts
    assert "--no-prefix-caching" in want["enable_prefix_caching"]  # the older name still parses


def test_eval_and_calibrate_take_their_engine_flags_from_engine_config():
    full = _engine_flags("generate")
    assert _engine_flags("eval") == {k: full[k] for k in EVAL_ENGINE_FIELDS}
    calibrate = _engine_flags("calibrate")  # its --kv-cache-dtype/--kv-rotation name what scales are for
    assert {k: calibrate[k] for k in ("model", "dtype", "device")} == {k: full[k] for k in ("model", "dtype", "device")}
    args = _parse("eval")
    for f in fields(EvalArgs):  # eval's own defaults: written once, in EvalArgs
        if f.name not in ("model", "report", "command"):
            want = f.default_factory() if f.default_factory is not MISSING else f.default
            assert getattr(args, f.name) == want, f.name


def test_flags_parse_to_engine_config_types():
    args = _parse(
        "serve",
        "--kv-cache-memory",
        "2GiB",
        "--num-blocks",
        "8",
        "--no-prefix-caching",
        "--kv-cache-dtype-skip-layers",
        "sliding_window",
        "0",
        "--batch-invariant",
    )
    cfg = EngineConfig(model="m", **engine_kwargs(args))
    assert (cfg.kv_cache_memory, cfg.num_blocks, cfg.enable_prefix_caching, cfg.batch_invariant) == (
        "2GiB",
        8,
        False,
        True,
    )
    assert cfg.kv_cache_dtype_skip_layers == ["sliding_window", "0"]
    assert _parse("serve", "--no-enable-prefix-caching").enable_prefix_caching is False
    with pytest.raises(SystemExit):
        _parse("serve", "--kv-rotation", "nope")
