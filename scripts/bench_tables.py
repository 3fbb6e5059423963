"""Print the README's and docs/benchmarks.md's tables from committed JSON files.

    python scripts/bench_tables.py [eval/results/bench]          # every benchmark table (scripts/bench_cpu.sh)
    python scripts/bench_tables.py --accuracy REPORT.json        # the accuracy table of one `qkv eval` report
    python scripts/bench_tables.py --vllm COMPARE.json           # qkv beside vLLM (scripts/bench_vllm.py)

Every ratio printed here was measured side by side in one run of one mode; the tables only reformat them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def _env(rep: dict) -> str:
    env = rep["env"]
    before = ", ".join(f"{x:.2f}" for x in env["load_average_before"])
    gemm = {"float32": ", linears in fp32", "model": f", linears in {rep['dtype']}"}.get(rep.get("cpu_matmul"), "")
    return f"{env['cpu']}, {env['threads']} threads{gemm}, load average before the run {before}"


def throughput(rep: dict) -> list[str]:
    p = rep["params"]
    rows = [
        f"Fixed KV budget: {p['num_requests']} requests x {p['prompt_len']} prompt tokens, {p['output_len']} output "
        f"tokens, `--kv-cache-memory {rep['engine'].get('kv_cache_memory')}` ({_env(rep)}):",
        "",
        f"| kv-cache dtype | KV budget (tokens) | output tok/s | ratio to {rep['baseline']} | preemptions "
        "| peak running |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, r in rep["results"].items():
        runs = r["runs"]
        rows.append(
            f"| {label} | {r['kv_budget_tokens']:,} | {r['output_tokens_per_s']:.1f} | "
            f"{r['ratio_to_' + rep['baseline']]:.2f}x | "
            f"{max(x['preemptions'] for x in runs)} | {max(x['peak_running'] for x in runs)} |"
        )
    return rows


def latency(rep: dict) -> list[str]:
    p = rep["params"]
    head = f"Latency, {p['prompt_len']}-token prompts, {p['output_len']} new tokens, medians of {p['repeats']} runs"
    rows = [f"{head} ({_env(rep)}):", ""]
    rows += [
        "| batch | config | TTFT ms | decode tok/s | decode vs qkv bf16 | decode vs transformers |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    base = rep["baseline"]
    for batch, row in rep["results"].items():
        for label, r in row.items():
            rel = r.get(f"decode_ratio_to_{base}")
            hf = r.get("decode_ratio_to_transformers")
            rows.append(
                f"| {batch.removeprefix('batch_')} | {label} | {r['ttft_ms']:.0f} | {r['decode_tokens_per_s']:.1f} | "
                f"{'' if rel is None else f'{rel:.2f}x'} | {'' if hf is None else f'{hf:.2f}x'} |"
            )
    return rows


def prefix(rep: dict) -> list[str]:
    rows = [f"Prefix of {rep['params']['prefix_len']} tokens, cold prefill against a hit ({_env(rep)}):", ""]
    tier = any("tier_hit_ttft_ms" in r for r in rep["results"].values())
    base = rep["baseline"]
    base_key = next(k for k in rep["results"] if k.startswith(base))  # with a tier: "bf16+ram"
    head = f"| config | cold TTFT ms | cold vs {base_key} | hit TTFT ms | cold / hit |"
    rows += [
        head + (" tier-hit TTFT ms | tier hit / cold | tier load share |" if tier else ""),
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if tier else ""),
    ]
    for label, r in rep["results"].items():
        line = (
            f"| {label} | {r['cold_ttft_ms']:.0f} | {r['cold_ttft_ratio_to_' + base_key]:.2f}x | "
            f"{r['hit_ttft_ms']:.1f} | {r['cold_over_hit']:.1f}x |"
        )
        if tier:
            line += (
                f" {r['tier_hit_ttft_ms']:.1f} | {r['tier_hit_over_cold']:.3f} | {r['tier_load_share_of_ttft']:.2f} |"
            )
        rows.append(line)
    return rows


def accuracy(rep: dict) -> list[str]:
    """One row per configuration: KV bytes per token, ppl delta with its 95 % interval, mean KL, top-1."""
    setup = rep["setup"]
    rows = [
        f"{rep['model']['name']}, {setup['num_windows']} x {setup['window']} tokens of {setup['dataset']}, "
        f"baseline {rep['baseline']} ({rep['environment']['cpu']}):",
        "",
        "| configuration | KV bytes/token | Δppl (95 % interval) | mean KL | top-1 agreement | gate |",
        "| --- | ---: | --- | ---: | ---: | --- |",
    ]
    for label, a in rep["accuracy"].items():
        lo, hi = a["ppl_delta_pct_ci95"]
        rows.append(
            f"| {label} | {rep['memory'][label]['kv_bytes_per_token']:,} | {a['ppl_delta_pct']:+.2f} % "
            f"[{lo:+.2f}, {hi:+.2f}] | {a['kl_mean']:.4f} | {100 * a['top1_agreement']:.1f} % | "
            f"{rep['verdicts'][label]['verdict']} |"
        )
    return rows


def vllm(rep: dict) -> list[str]:
    """qkv beside vLLM's CPU build: each workload's metric, medians of the interleaved repeats, and the ratios."""
    env = rep["env"]
    rows = [
        f"{env['cpu']['name']} ({', '.join(env['cpu']['flags'])}), {env['torch_threads']} threads, medians of "
        f"{rep['repeats']} interleaved repeats; load average before the run {env['load_average_before'][0]:.2f}:",
        "",
        "| workload | metric | qkv bf16 | qkv fp8 | qkv int8 | qkv int8_per_token_head | vLLM bf16 | vLLM fp8 "
        "| qkv / vLLM, bf16 | qkv / vLLM, fp8 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {"budget": "output tok/s", "decode16": "seconds", "prefill": "seconds", "itl": "ms per token"}
    keys = {"budget": "output_tokens_per_s", "decode16": "seconds", "prefill": "seconds", "itl": "itl_ms"}
    for w, res in rep["results"].items():
        spec = rep["workloads"][w]
        label = f"{w}: {spec['requests']} x ({spec['prompt_len']} + {spec['output_len']}), {spec['kv_mib']} MiB"
        cells = [
            f"{res[c][keys[w]]:.4g}" if c in res else "-"
            for c in ("qkv bf16", "qkv fp8", "qkv int8", "qkv int8_per_token_head", "vllm bf16", "vllm fp8")
        ]
        ratio = [
            f"{res[c][k]:.2f}x" if k in res.get(c, {}) else "-"  # no ratio where vLLM could not run the dtype
            for c, k in (("qkv bf16", "speed_vs_vllm_bf16"), ("qkv fp8", "speed_vs_vllm_fp8"))
        ]
        rows.append(f"| {label} | {names[w]} | " + " | ".join(cells + ratio) + " |")
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["--vllm"]:
        print("\n".join(vllm(json.loads(Path(argv[1]).read_text()))))
        return 0
    if argv[:1] == ["--accuracy"]:
        print("\n".join(accuracy(json.loads(Path(argv[1]).read_text()))))
        return 0
    folder = Path(argv[0] if argv else "eval/results/bench")
    for name, render in (
        ("throughput_smollm2.json", throughput),
        ("latency_smollm2.json", latency),
        ("decode16_smollm2.json", latency),
        ("prefix_smollm2.json", prefix),
        ("prefix_offload_smollm2.json", prefix),
        ("throughput_4bit_smollm2.json", throughput),
        ("throughput_4bit_fitsall_smollm2.json", throughput),
        ("decode16_4bit_smollm2.json", latency),
    ):
        rep = _load(folder, name)
        if rep is not None:
            print(f"<!-- {folder / name} -->")
            print("\n".join(render(rep)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
