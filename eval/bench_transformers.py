"""``qkv bench --mode latency``'s baselines: ``transformers.generate`` on the same weights and token ids.

Two of them when qkv's engines multiply a 16-bit model's linears in fp32 (qkv.cpu_linear):
``transformers`` as a user runs it, and ``transformers+fp32``, the same model under the same
:class:`~qkv.cpu_linear.Fp32Linear` mode, so that the engine is also compared on equal arithmetic.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import AutoModelForCausalLM

from qkv.cpu_linear import Fp32Linear
from qkv.engine import LLMEngine

__all__ = ["Baseline", "load_baselines"]


class _FirstTokenTime:
    """A ``transformers`` streamer that notes when the first generated token arrives (the prompt comes first)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class Baseline:
    """One ``transformers`` baseline: the model, and the mode its ``generate`` runs under."""

    def __init__(self, model, mode: Fp32Linear | None = None) -> None:
        self.model, self.mode = model, mode

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """(TTFT of the batch, total seconds) for ``transformers.generate`` on ``prompts``."""
        ids = torch.tensor(prompts, device=self.model.device)
        streamer = _FirstTokenTime()
        t0 = time.perf_counter()
        with torch.inference_mode(), self.mode or contextlib.nullcontext():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        assert streamer.first is not None
        return streamer.first - t0, time.perf_counter() - t0


def load_baselines(engine: LLMEngine, warm: list[list[int]]) -> dict[str, Baseline]:
    """``transformers`` (and ``transformers+fp32`` where ``engine`` multiplies in fp32), warmed on ``warm``."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(engine.model_path), dtype=engine.dtype, attn_implementation="sdpa"
    )
    model = model.to(engine.device).eval()
    out = {"transformers": Baseline(model)}
    if engine.matmul_fp32:
        out["transformers+fp32"] = Baseline(model, Fp32Linear(model))
    for b in out.values():
        b.run(warm, 2)  # first calls initialise lazily
    return out
