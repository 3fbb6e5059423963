"""``qkv eval`` and ``qkv lm-eval`` subcommands (``qkv/cli.py`` calls :func:`register`)."""

from __future__ import annotations

import argparse
import shlex
import sys

from qkv.config_flags import add_config_args, add_engine_args, config_kwargs, engine_kwargs
from qkv.options import option_default

from .bench import BENCH_ENGINE_FIELDS, BenchOptions, run_bench
from .report import verdict_lines
from .run import EvalArgs, run_eval
from .search import SearchArgs, run_search

__all__ = ["register", "main_eval", "main_lm_eval"]


# Eval's engines differ from the engine's defaults in these (scores in bfloat16, a smaller cache per configuration);
# their names, types and help still come from EngineConfig, their defaults from EvalArgs.
EVAL_ENGINE_FIELDS = ("model", "dtype", "kv_cache_memory", "max_model_len", "device", "cpu_matmul_dtype")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, EVAL_ENGINE_FIELDS, {k: option_default(EvalArgs, k) for k in EVAL_ENGINE_FIELDS if k != "model"})
    add_config_args(p, EvalArgs)
    add_config_args(p.add_argument_group("search", SearchArgs.__doc__), SearchArgs)


def _command(args: argparse.Namespace, kwargs: dict) -> str:
    """The command line that reproduces this run (options that differ from the defaults)."""
    p = argparse.ArgumentParser()
    add_eval_args(p)
    defaults = vars(p.parse_args([args.model, "--report", args.report]))
    parts = ["qkv", "eval", args.model]
    for k, v in kwargs.items():
        if k in ("model", "command", "report") or v == defaults.get(k):
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            parts.append(flag)
        elif isinstance(v, list):
            parts += [flag, ",".join(map(str, v)) or "none"]
        else:
            parts += [flag, str(v)]
    return shlex.join(parts + ["--report", args.report])


def _search(args: argparse.Namespace, eval_args: EvalArgs) -> int:
    search = SearchArgs(**config_kwargs(SearchArgs, args))
    extra = [
        "--search",
        "--search-dtypes",
        ",".join(search.dtypes),
        "--search-strategies",
        ",".join(search.strategies),
        "--search-rotations",
        ",".join(search.rotations),
        "--calib-samples",
        str(search.calib_samples),
    ]
    extra += ["--calib-seq-len", str(search.calib_seq_len)] if search.calib_seq_len else []
    extra += [] if search.dynamic else ["--no-search-dynamic"]
    extra += ["--calib-dataset", search.calib_dataset] if search.calib_dataset else []
    eval_args.command = f"{eval_args.command} {shlex.join(extra)}"
    _, rec, code = run_search(eval_args, search)
    best = rec["recommended"]
    for row in rec["ranked"]:
        lo, hi = row["ppl_delta_pct_ci95"]
        print(
            f"  {row['config']:<36} {row['kv_bytes_per_token']:>7,} B/token  ppl {row['ppl_delta_pct']:+.3f}% "
            f"[{lo:+.3f}, {hi:+.3f}]  {'within' if row['within_budget'] else 'over'} budget"
        )
    if best:
        print(
            f"recommended: {best['config']} ({best['kv_bytes_per_token']:,} B/token, ppl {best['ppl_delta_pct']:+.3f}%)"
        )
    else:
        print(f"no configuration is within --max-ppl-delta {rec['max_ppl_delta_pct']:g}%")
    print(f"report: {args.report}/search.md, report.html, report.md, report.json")
    return code


def main_eval(args: argparse.Namespace) -> int:
    kwargs = config_kwargs(EvalArgs, args, exclude=("command",))
    kwargs["command"] = _command(args, kwargs)
    if args.search:
        return _search(args, EvalArgs(**kwargs))
    r, code = run_eval(EvalArgs(**kwargs))
    print("\n".join(verdict_lines(r)))
    if r.get("compare"):
        for f in r["compare"]["flags"]:
            print(
                f"  worse: {f['config']} {f['metric']} ({f['kind']}): {f['old']:.5g} -> {f['new']:.5g}, "
                f"old interval [{f['old_interval'][0]:.5g}, {f['old_interval'][1]:.5g}]"
            )
    print(f"report: {args.report}/report.html, report.md, report.json")
    return code


def main_lm_eval(args: argparse.Namespace) -> int:
    """Register the ``qkv`` model with lm-eval, add qkv's local tasks, and hand over to lm-eval's CLI."""
    # lm-eval is an optional extra (pip install 'qkv[lm-eval]'): imported only when this command runs
    from . import lm_eval_model

    lm_eval_model.register()
    rest = list(args.lm_eval_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not any(a == "--model" or a.startswith("--model=") for a in rest):
        rest = ["--model", "qkv"] + rest
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in rest):
        rest += ["--include_path", str(lm_eval_model.TASKS_DIR)]
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    old_argv = sys.argv
    sys.argv = ["lm-eval", "run"] + rest
    try:
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    finally:
        sys.argv = old_argv
    return 0


def main_bench(args: argparse.Namespace) -> int:
    run_bench(args.model, BenchOptions(**config_kwargs(BenchOptions, args)), engine_kwargs(args))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="speed of every KV-cache dtype side by side: throughput at a fixed KV "
        "budget, latency vs transformers, prefix-hit TTFT",
    )
    add_engine_args(p, BENCH_ENGINE_FIELDS)
    add_config_args(p, BenchOptions)
    p.set_defaults(func=main_bench)
    p = sub.add_parser(
        "eval",
        help="accuracy (ppl, KL, top-1), latency and memory of KV-cache configurations",
        description="Evaluate KV-cache configurations against a baseline through the paged "
        "engine and write report.{json,md,html}. Exit 1 when a threshold or "
        "--compare gate fails, 2 on bad input.",
    )
    add_eval_args(p)
    p.set_defaults(func=main_eval)
    p = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness with the qkv engine as the model",
        description="Everything after 'lm-eval' goes to lm-eval's 'run' command; --model "
        "defaults to qkv and qkv's local tasks (qkv_wikitext, qkv_mc) are included. "
        "Example: qkv lm-eval --model_args pretrained=smollm2-135m,kv_cache_dtype=fp8 "
        "--tasks qkv_wikitext,qkv_mc",
        prefix_chars="+",
        add_help=False,
    )  # every '-' argument, -h included, is lm-eval's
    p.add_argument("lm_eval_args", nargs="*")
    p.set_defaults(func=main_lm_eval)
