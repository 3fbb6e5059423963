"""``qkv eval``: every configuration through the same paged engine, then the report and the gate.

Order of work: parse and check everything that can be checked without a
forward pass (configurations, thresholds, the ``--compare`` file, the dataset's
token count, TTFT lengths and window against ``max_model_len``), then accuracy,
then latency, then the report. Any error before the report is written leaves no
new report behind; if the report directory already holds an older report, an
``EVAL_FAILED.txt`` beside it says that the latest run failed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.llm import LLM
from qkv.metrics import parse_threshold
from qkv.model_loader import load_tokenizer
from qkv.options import option
from qkv.registry import resolve_model

from . import accuracy, data, gate, latency, report, scales_table, server
from .configs import EvalConfig, ServerConfig, parse_configs

__all__ = ["EvalArgs", "run_eval", "model_identity", "environment"]

logger = logging.getLogger("qkv.eval")
FAILED_MARKER = "EVAL_FAILED.txt"


@dataclass
class EvalArgs:
    """``qkv eval``'s options, written once: its flags come from these fields (the engine ones, dtype to
    cpu_matmul_dtype, from EngineConfig's, with the defaults written here: eval scores in bfloat16 and gives each
    configuration a smaller cache)."""

    model: str = option(cli=False)
    configs: str = option(
        "bf16,fp8",
        "comma-separated DTYPE[:SCALES_DIR][+skip=LAYERS]; LAYERS: sliding_window and/or indices separated by "
        "'/' or ';'. The first configuration is the baseline",
    )
    dataset: str = option(
        "wikitext",
        "wikitext (WikiText-2 raw test; the local shared copy when present, else the hub) or a .txt/.raw/.jsonl file",
    )
    num_windows: int = option(16, "windows scored", ge=1)
    window: int = option(1024, "tokens per window (BOS included when the tokenizer adds one)", ge=2)
    ttft_lengths: list[int] = option(
        help="prompt lengths for TTFT; 'none' skips latency", default_factory=lambda: [512, 2048], sep=","
    )
    repeats: int = option(3, "interleaved repeats of every latency measurement", ge=1)
    decode_batches: list[int] = option(
        help="batch sizes of the decode timing", default_factory=lambda: [1, 16], sep=","
    )
    decode_prompt_len: int = option(128, "prompt tokens of the decode timing", ge=1)
    decode_tokens: int = option(16, "tokens decoded per timing", ge=2)
    kv_budget: str = option("1GiB", "KV budget for the max-concurrency figure (e.g. 1GiB)")
    memory_len: int = option(2048, "sequence length for the max-concurrency figure", ge=1)
    report: str = option("eval_report", "directory for report.json, report.md and report.html", required=True)
    max_ppl_delta: str | float | None = option(None, "gate: fail when a ppl delta exceeds this (e.g. 1.0%%)")
    max_kl: str | float | None = option(None, "gate: fail when a mean per-token KL exceeds this")
    compare: str | None = option(None, "an earlier report.json (same model and report version)")
    gate_latency: bool = option(False, "latency regressions in --compare fail too")
    dtype: str = option("bfloat16", cli=False)
    kv_cache_memory: str = option("512MiB", cli=False)
    max_model_len: int | None = option(None, cli=False)
    chunk_size: int | None = option(None, "prefill chunk for scoring (default: the engine's)", ge=1)
    bootstrap: int = option(2000, "bootstrap resamples", ge=1)
    seed: int = option(0, "seed of the bootstrap and of the timing prompts")
    device: str | None = option(None, cli=False)
    cpu_matmul_dtype: str = option("auto", cli=False)
    server_api_key: str | None = option(None, "API key of the NAME=URL configurations' servers (default: none)")
    command: str | None = option(None, cli=False)  # the command line that reproduces the run (report)


def model_identity(name: str, path: Path) -> dict:
    """Name, path and a fingerprint: sha256 over config.json and the weight files."""
    h = hashlib.sha256()
    for f in [path / "config.json"] + sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return {"name": name, "path": str(path), "fingerprint": h.hexdigest()}


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def environment(seed: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu or "none",
    }
    for pkg in ("qkv", "torch", "transformers", "numpy", "datasets", "matplotlib", "lm_eval", "triton"):
        env[pkg] = _version(pkg)
    env["seed"] = seed
    return env


def _check_lengths(engines: dict, args: EvalArgs, timed: bool = True) -> None:
    if not engines:  # servers only: they refuse what they cannot hold
        return
    mml = min(e.max_model_len for e in engines.values())
    too_long = [L for L in args.ttft_lengths if mml < L] if timed else []
    if too_long:
        raise ValueError(
            f"--ttft-lengths {too_long[0]} is longer than max_model_len={mml}; "
            f"use shorter prompts or raise --max-model-len/--kv-cache-memory"
        )
    if args.window > mml:
        raise ValueError(f"--window {args.window} is longer than max_model_len={mml}")
    if args.decode_prompt_len + args.decode_tokens > mml:
        raise ValueError(
            f"decode prompts of {args.decode_prompt_len}+{args.decode_tokens} tokens exceed max_model_len={mml}"
        )


def _build_engines(configs: list[EvalConfig | ServerConfig], args: EvalArgs) -> dict:
    engines = {}
    shared = None  # one copy of the weights for every configuration
    for c in configs:
        if isinstance(c, ServerConfig):
            continue
        logger.info("loading %s", c.label)
        llm = LLM(
            args.model,
            preloaded_model=shared,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.max_model_len,
            device=args.device,
            cpu_matmul_dtype=args.cpu_matmul_dtype,
            **c.engine_kwargs(),
        )
        engines[c.label] = llm.llm_engine
        shared = llm.llm_engine.model
    return engines


def _unquantized(engine) -> list[int]:
    """Layers kept in the model dtype (skip flags, or a checkpoint's auto-skip choice)."""
    return [s.layer_idx for s in engine.layer_specs if not s.dtype.quantized]


def _validate(args: EvalArgs) -> None:
    for name in ("num_windows", "window", "repeats", "decode_prompt_len", "decode_tokens", "memory_len", "bootstrap"):
        if getattr(args, name) < (0 if name == "repeats" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(L < 1 for L in args.ttft_lengths) or any(b < 1 for b in args.decode_batches):
        raise ValueError("--ttft-lengths and --decode-batches take positive integers")


def run_eval(args: EvalArgs) -> tuple[dict, int]:
    """Run everything; return (report dict, exit code: 0 pass, 1 gate or compare failed)."""
    out_dir = Path(args.report)
    try:
        result = _run(args)
    except BaseException as e:
        if (out_dir / "report.json").exists():
            (out_dir / FAILED_MARKER).write_text(
                f"The latest qkv eval into this directory failed ({time.strftime('%Y-%m-%d %H:%M:%S')}):\n"
                f"{type(e).__name__}: {e}\nThe report files here are from an earlier run.\n"
            )
        raise
    (out_dir / FAILED_MARKER).unlink(missing_ok=True)
    return result


def _run(args: EvalArgs) -> tuple[dict, int]:
    t_start = time.time()
    _validate(args)
    configs = parse_configs(args.configs)
    max_ppl = parse_threshold(args.max_ppl_delta, "--max-ppl-delta")
    max_kl = parse_threshold(args.max_kl, "--max-kl")
    model_path = Path(resolve_model(args.model))
    model = model_identity(args.model, model_path)
    old = gate.load_compare(args.compare, model) if args.compare else None
    text = data.load_text(args.dataset)
    windows = data.make_windows(load_tokenizer(model_path), text.text, args.num_windows, args.window)
    servers = [c for c in configs if isinstance(c, ServerConfig)]
    # servers are asked first: an unreachable one fails before any model loads
    scorers = {c.label: server.ServerScorer(c.url, args.server_api_key) for c in servers}
    engines = _build_engines(configs, args)
    _check_lengths(engines, args, timed=not servers)
    base = configs[0].label
    if servers:  # every configuration in the servers' view: top-20 logprobs through the completions API
        scorers.update({k: server.EngineScorer(e, args.chunk_size) for k, e in engines.items()})
        tokens = server.score_windows_topk({c.label: scorers[c.label] for c in configs}, windows, base)
    else:
        tokens = accuracy.score_windows(engines, windows, base, args.chunk_size)
    acc = accuracy.summarize(tokens, base, args.bootstrap, args.seed)
    lat = None
    if args.ttft_lengths and args.repeats and not servers:
        lat = latency.measure_latency(
            engines,
            base,
            args.ttft_lengths,
            args.repeats,
            args.decode_batches,
            args.decode_prompt_len,
            args.decode_tokens,
            args.seed,
        )
    mem = {k: latency.memory_metrics(e, args.kv_budget, args.memory_len) for k, e in engines.items()}
    scales = {}
    for c in configs:
        got = None if isinstance(c, ServerConfig) else scales_table.layer_ranges(engines[c.label], c.scales)
        if got is not None:
            scales[c.label] = got
    first = engines.get(base) or next(iter(engines.values()), None)
    r = {
        "kind": gate.REPORT_KIND,
        "report_version": gate.REPORT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": args.command or f"python: qkv.eval.run.run_eval({args!r})",
        "model": {
            **model,
            **(
                {}
                if first is None
                else {
                    "dtype": str(first.dtype).replace("torch.", ""),
                    "num_layers": len(first.layer_specs),
                    "max_model_len": first.max_model_len,
                }
            ),
        },
        "baseline": base,
        "configs": [
            c.to_json()
            if isinstance(c, ServerConfig)
            else {
                **c.to_json(),
                "cache": engines[c.label].cache.dtype_summary(),
                "unquantized_layers": _unquantized(engines[c.label]) if c.quantized else [],
            }
            for c in configs
        ],
        "setup": {
            "dataset": text.name,
            "dataset_source": text.source,
            "dataset_sha256": text.sha256,
            "dataset_file_sha256": text.file_sha256,
            "num_windows": args.num_windows,
            "window": args.window,
            "scored_tokens_per_window": len(windows[0]) - 1,
            "seed": args.seed,
            "bootstrap_resamples": args.bootstrap,
            "chunk_size": args.chunk_size,
            "ttft_lengths": args.ttft_lengths,
            "repeats": args.repeats,
            "decode_batches": args.decode_batches,
            "decode_prompt_len": args.decode_prompt_len,
            "decode_tokens": args.decode_tokens,
            "kv_cache_memory": args.kv_cache_memory,
            "cpu_matmul": None if first is None else first.cpu_matmul,
            "kl": (
                f"top-{server.TOP_K} KL over the baseline's top tokens, renormalized (eval/server.py)"
                if servers
                else "full-vocabulary KL"
            ),
            "servers": {c.label: c.url for c in servers},
        },
        "gate": {"max_ppl_delta": max_ppl, "max_kl": max_kl},
        "verdicts": gate.verdicts(acc, base, max_ppl, max_kl),
        "accuracy": acc,
        "latency": lat,
        "memory": mem,
        "scales": scales,
        "compare": None,
        "environment": environment(args.seed),
    }
    failed = any(v["verdict"] == "FAIL" for v in r["verdicts"].values())
    if old is not None:
        r["compare"] = gate.compare(r, old, args.gate_latency)
        r["compare"]["source"] = str(args.compare)
        failed = failed or r["compare"]["failed"]
    r["gate"]["passed"] = not failed
    r["elapsed_s"] = time.time() - t_start
    report.write_report(r, args.report)
    return r, 1 if failed else 0
