"""``qkv eval`` and ``qkv lm-eval`` subcommands (``qkv/cli.py`` calls :func:`register`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import MISSING, fields
from typing import Any

from qkv.config_flags import add_engine_args

from .report import verdict_lines
from .run import EvalArgs, run_eval
from .search import SearchArgs, run_search

__all__ = ["register", "main_eval", "main_lm_eval"]


def _ints(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# Eval's engines differ from the engine's defaults in these (scores in bfloat16, a smaller cache per configuration);
# their names, types and help still come from EngineConfig.
EVAL_ENGINE_FIELDS = ("model", "dtype", "kv_cache_memory", "max_model_len", "device", "cpu_matmul_dtype")


def _default(name: str) -> Any:
    """EvalArgs' default for ``name``: the one place eval's defaults are written."""
    f = next(f for f in fields(EvalArgs) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


def add_eval_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, EVAL_ENGINE_FIELDS, {k: _default(k) for k in EVAL_ENGINE_FIELDS if k != "model"})
    p.add_argument(
        "--configs",
        default=_default("configs"),
        help="comma-separated DTYPE[:SCALES_DIR][+skip=LAYERS]; LAYERS: sliding_window and/or "
        "indices separated by '/' or ';'. The first configuration is the baseline "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--dataset",
        default=_default("dataset"),
        help="wikitext (WikiText-2 raw test; the local shared copy when present, else the hub) "
        "or a .txt/.raw/.jsonl file",
    )
    p.add_argument("--num-windows", type=int, default=_default("num_windows"))
    p.add_argument(
        "--window",
        type=int,
        default=_default("window"),
        help="tokens per window (BOS included when the tokenizer adds one)",
    )
    p.add_argument(
        "--ttft-lengths",
        type=_ints,
        default=_default("ttft_lengths"),
        help="prompt lengths for TTFT, comma-separated; 'none' skips latency",
    )
    p.add_argument(
        "--repeats", type=int, default=_default("repeats"), help="interleaved repeats of every latency measurement"
    )
    p.add_argument("--decode-batches", type=_ints, default=_default("decode_batches"))
    p.add_argument("--decode-prompt-len", type=int, default=_default("decode_prompt_len"))
    p.add_argument("--decode-tokens", type=int, default=_default("decode_tokens"))
    p.add_argument(
        "--kv-budget", default=_default("kv_budget"), help="KV budget for the max-concurrency figure (e.g. 1GiB)"
    )
    p.add_argument(
        "--memory-len", type=int, default=_default("memory_len"), help="sequence length for the max-concurrency figure"
    )
    p.add_argument("--report", required=True, help="directory for report.json, report.md and report.html")
    p.add_argument(
        "--max-ppl-delta",
        default=_default("max_ppl_delta"),
        help="gate: fail when a ppl delta exceeds this (e.g. 1.0%%)",
    )
    p.add_argument("--max-kl", default=_default("max_kl"), help="gate: fail when a mean per-token KL exceeds this")
    p.add_argument(
        "--compare", default=_default("compare"), help="an earlier report.json (same model and report version)"
    )
    p.add_argument("--gate-latency", action="store_true", help="latency regressions in --compare fail too")
    p.add_argument(
        "--chunk-size", type=int, default=_default("chunk_size"), help="prefill chunk for scoring (default: engine's)"
    )
    p.add_argument("--bootstrap", type=int, default=_default("bootstrap"), help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=_default("seed"))
    g = p.add_argument_group(
        "search",
        "--search: calibrate and evaluate the dtype x strategy x rotation grid "
        "(replaces --configs) and recommend the smallest KV footprint within "
        "--max-ppl-delta",
    )
    g.add_argument("--search", action="store_true")
    grid = SearchArgs()
    g.add_argument(
        "--search-dtypes", default=",".join(grid.dtypes), help="static dtypes of the grid (default %(default)s)"
    )
    g.add_argument("--search-strategies", default=",".join(grid.strategies), help="default %(default)s")
    g.add_argument("--search-rotations", default=",".join(grid.rotations), help="default %(default)s")
    g.add_argument(
        "--no-search-dynamic",
        dest="search_dynamic",
        action="store_false",
        help="leave fp8/int8_per_token_head out of the grid",
    )
    g.add_argument(
        "--calib-dataset",
        default=None,
        help="calibration text for the grid's scales (default: the WikiText-2 validation split)",
    )
    g.add_argument("--calib-samples", type=int, default=grid.calib_samples)
    g.add_argument(
        "--calib-seq-len",
        type=int,
        default=None,
        help="tokens per calibration sample (default: --window, so every evaluated position is seen)",
    )


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
    def split(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    search = SearchArgs(
        split(args.search_dtypes),
        split(args.search_strategies),
        split(args.search_rotations),
        args.search_dynamic,
        args.calib_dataset,
        args.calib_samples,
        args.calib_seq_len,
    )
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
    fields = EvalArgs.__dataclass_fields__
    kwargs = {k: v for k, v in vars(args).items() if k in fields and k != "command"}
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


def register(sub) -> None:
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
