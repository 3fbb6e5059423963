"""Logits for every position of a token sequence, computed through the paged engine.

Perplexity, KL and calibration need what serving would see: each chunk's K/V
are written to the (possibly quantized) cache first and attention reads them
back (write-then-attend), so every logit reflects the cache's quantization.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .runner import build_step_inputs
from .sampling import SamplingParams
from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import Sequence

__all__ = ["prefill_logits"]


@torch.inference_mode()
def prefill_logits(
    engine,
    token_ids: list[int],
    observer: Callable | None = None,
    chunk_size: int | None = None,
    keep_logits: bool = True,
) -> torch.Tensor | None:
    """Run ``token_ids`` through the engine's model and cache; return fp32 logits ``[T, vocab]``.

    The sequence gets its own blocks (no prefix-cache lookup, so every token is
    computed), prefilled in chunks of ``chunk_size`` tokens (default:
    ``max_num_batched_tokens``), and its blocks are freed afterwards.
    ``observer(layer_idx, key, value, query)`` sees the K/V written to the cache and the queries.
    """
    if not token_ids:
        raise ValueError("cannot score an empty token sequence")
    if len(token_ids) > engine.max_model_len:
        raise ValueError(f"sequence has {len(token_ids)} tokens, more than max_model_len={engine.max_model_len}")
    chunk_size = chunk_size or engine.config.max_num_batched_tokens
    seq = Sequence("__score__", token_ids, SamplingParams(max_tokens=1), engine.block_size)
    outs = []
    try:
        while seq.num_computed_tokens < seq.num_tokens:
            n = min(chunk_size, seq.num_tokens - seq.num_computed_tokens)
            if not engine.kv_manager.allocate_slots(seq, n):
                raise ValueError(f"not enough free KV blocks to score {len(token_ids)} tokens")
            inp = build_step_inputs(SchedulerOutput([ScheduledSeq(seq, n)]), engine.block_size)
            logits = engine.runner.forward(inp, range(n) if keep_logits else [], observer=observer)
            if keep_logits:
                outs.append(logits.float())
            seq.num_computed_tokens += n
    finally:
        engine.kv_manager.free(seq)
    return torch.cat(outs) if keep_logits else None
