"""How vLLM's CPU backend rounds a value into its fp8 (e4m3) KV cache, measured through its own cache-write op.

Run with the vLLM venv's python (``bash scripts/vllm_venv.sh``); it starts no engine, it calls
``torch.ops._C.cpu_attn_reshape_and_cache`` (vLLM 0.32's ``CPU_ATTN`` backend) on known values and reads the
bytes back, for every finite bf16 value and for random data, at scale 1 and at other scales. Each byte is
compared with round-to-nearest-even (torch's ``.to(torch.float8_e4m3fn)``, what qkv writes) and with rounding
toward zero, and the mean relative shrink that the rounding causes is reported:

    .venv-vllm/bin/python scripts/vllm_fp8_rounding.py -o eval/results/vllm/fp8_rounding.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

BS, D = 32, 64
FINITE = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0x7f is NaN


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """x rounded toward zero onto the e4m3 grid, saturated at +-448, as e4m3."""
    a = x.abs().float().clamp(max=448.0)
    idx = torch.searchsorted(FINITE, a, right=True) - 1
    return (FINITE[idx] * torch.sign(x.float())).to(torch.float8_e4m3fn)


def nearest_even(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def vllm_bytes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The e4m3 codes vLLM's cache write stores for the values ``x`` (as V, one kv head; the ``vec`` layout keeps
    V row-major inside a block), with ``v_scale = scale``."""
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

    n = x.numel()
    rows = math.ceil(n / D)
    tokens = math.ceil(rows / BS) * BS
    buf = torch.zeros(tokens * D, dtype=x.dtype)
    buf[:n] = x
    value = buf.view(tokens, 1, D)
    blocks = tokens // BS
    kv = torch.zeros(blocks, 1, BS, 2 * D, dtype=torch.uint8)
    k_cache, v_cache = kv.view(blocks, 1, 2 * BS, D).chunk(2, dim=2)
    slots = torch.arange(tokens, dtype=torch.int64)
    torch.ops._C.cpu_attn_reshape_and_cache(
        value, value, k_cache, v_cache, slots, "vec", k_scale=scale, v_scale=scale, kv_cache_dtype="fp8"
    )
    return v_cache[:, 0].reshape(-1)[:n].contiguous()


def compare(x: torch.Tensor, scale: float) -> dict:
    got = vllm_bytes(x, scale)
    xs = x.float() / scale
    finite = torch.isfinite(xs)
    as_zero = (got.view(torch.float8_e4m3fn).float() == 0) & finite

    def agree(codes: torch.Tensor) -> float:
        same = (codes.view(torch.uint8) == got) | (as_zero & (codes.float() == 0))
        return float(same[finite].float().mean())

    stored = got.view(torch.float8_e4m3fn).float()
    inside = finite & (xs.abs() > 2**-6) & (xs.abs() < 448)  # normal e4m3 range: relative error is meaningful
    shrink = float((1 - stored[inside] / xs[inside]).mean())
    rne = nearest_even(xs)
    rne_shrink = float((1 - rne.float()[inside] / xs[inside]).mean())
    return {
        "values": int(finite.sum()),
        "equal_to_toward_zero": agree(toward_zero(xs)),
        "equal_to_nearest_even": agree(rne),
        "mean_relative_shrink": shrink,
        "mean_relative_shrink_nearest_even": rne_shrink,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    import vllm

    torch.manual_seed(0)
    bf16 = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf16 = bf16[torch.isfinite(bf16.float())]
    rand = (torch.randn(200_000) * torch.exp(torch.randn(200_000) * 2)).to(torch.bfloat16)
    examples = torch.tensor([1.09375, 1.1875, -1.09375, 440.0, 0.0029296875], dtype=torch.bfloat16)
    got = vllm_bytes(examples, 1.0).view(torch.float8_e4m3fn).float()
    report = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "op": "torch.ops._C.cpu_attn_reshape_and_cache, kv_cache_dtype='fp8' (e4m3), isa 'vec'",
        "every finite bf16, scale 1": compare(bf16, 1.0),
        "random bf16, scale 1": compare(rand, 1.0),
        "random bf16, scale 0.37": compare(rand, 0.37),
        "random bf16, scale 7.3": compare(rand, 7.3),
        "examples": {
            str(float(x)): {"vllm": float(v), "nearest_even": float(nearest_even(x.reshape(1)).float())}
            for x, v in zip(examples, got)
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
