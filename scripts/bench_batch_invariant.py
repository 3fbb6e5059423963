"""--batch-invariant's linears two ways, alternated in one process: the fixed 48-row tiles against the kernel.

    .venv/bin/python scripts/bench_batch_invariant.py -o eval/results/bench/batch_invariant_epyc_zen3_smollm2.json

transformers' greedy generate of SmolLM2-135M in bf16 (``--prompts`` of tests/support's prompts, 64 tokens each)
under the linear modes of a CPU whose linears multiply in fp32 (``cpu_matmul_dtype float32``):

* ``tiles``: fp32 copies through ``F.linear`` in zero-padded 48-row calls (``Fp32Linear(min_rows=1)`` under
  ``BatchInvariantLinear``), what ``--batch-invariant`` ran before the kernel took its linears;
* ``kernel``: what :func:`qkv.cpu_linear.linear_modes` picks now (``KernelLinear``, the tiles on top).

Each is row-invariant, in a summation order of its own, so their tokens may differ; the JSON says whether they
did, with the seconds of each round, the CPU's flags, the threads and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qkv.batch_invariant import BatchInvariantLinear
from qkv.cpu_linear import Fp32Linear, linear_modes
from qkv.eval.machine import cpu_info, write_report
from qkv.registry import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.prompts import PROMPTS  # noqa: E402  (the test suite's prompts, not a package)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    env = {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "load_average_before": os.getloadavg()}
    path = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    tiles = Fp32Linear(model, min_rows=1, onednn=False)
    arms = {"tiles": [lambda: tiles, BatchInvariantLinear], "kernel": linear_modes(model, "float32", True)}
    ids = [tok(p, return_tensors="pt").input_ids for p in PROMPTS[: args.prompts]]
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for arm, modes in arms.items():
            t0, outs = time.perf_counter(), []
            for x in ids:
                with contextlib.ExitStack() as stack:
                    for make in modes:
                        stack.enter_context(make())
                    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
                outs.append(out[0, x.shape[1] :].tolist())
            seconds[arm].append(time.perf_counter() - t0)
            tokens[arm] = outs
    report = {
        "env": env,
        "modes": {arm: [type(m()).__name__ for m in modes] for arm, modes in arms.items()},
        "prompts": len(ids),
        "new_tokens": 64,
        "seconds": seconds,
        "speedup": min(seconds["tiles"]) / min(seconds["kernel"]),
        "same_tokens": tokens["tiles"] == tokens["kernel"],
    }
    print({arm: [round(s, 1) for s in v] for arm, v in seconds.items()}, f"{report['speedup']:.2f}x")
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
