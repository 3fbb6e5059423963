"""Turn a scheduled step into one flattened forward pass and sample from it.

All sequences of a step are concatenated into a single batch of one row
(``input_ids [1, T]``) with explicit ``position_ids``; each sequence's slice of
the row is described by ``query_start_loc`` and ``seq_lens`` (vLLM's varlen
metadata), and its cache by a block table. Only the rows that need a next
token produce logits (``logits_to_keep`` with indices).
"""

from __future__ import annotations

import contextlib

import torch

from .attention import AttentionBackend, StepContext
from .batch_invariant import BatchInvariantLinear
from .kv_cache import KVCache
from .sampling import SamplingError, sample
from .scheduler import SchedulerOutput

__all__ = ["ModelRunner", "StepInputs", "build_step_inputs"]


class StepInputs:
    """Host-built tensors of one step (kept separate so tests can check them exactly)."""

    def __init__(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
                 block_tables: list[list[int]], seq_lens: list[int], query_start_loc: list[int],
                 logits_indices: list[int]) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.query_start_loc = query_start_loc
        self.logits_indices = logits_indices


def build_step_inputs(sched: SchedulerOutput, block_size: int) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    qsl = [0]
    logits_indices: list[int] = []
    for item in sched.scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        tokens = seq.all_token_ids
        ids = seq.block_ids
        input_ids.extend(tokens[start:start + n])
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        tables.append(ids)
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        if item.samples:
            logits_indices.append(qsl[-1] - 1)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]  # pad with the null block
    return StepInputs(input_ids, positions, slots, tables, seq_lens, qsl, logits_indices)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: AttentionBackend,
                 device: torch.device, batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.cache = cache
        self.backend = backend
        self.device = device

    def context(self, inp: StepInputs, observer=None) -> StepContext:
        dev = self.device
        return StepContext(
            cache=self.cache,
            backend=self.backend,
            slot_mapping=torch.tensor(inp.slot_mapping, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(inp.block_tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(inp.query_start_loc, dtype=torch.int32, device=dev),
            observer=observer,
        )

    @torch.inference_mode()
    def forward(self, inp: StepInputs, logits_indices: list[int] | None = None,
                observer=None) -> torch.Tensor:
        """Run the model over the flattened step; returns logits for ``logits_indices`` rows.

        ``logits_indices=None`` uses the sampling rows; pass ``range(T)`` to get
        every position (perplexity evaluation).
        """
        idx = inp.logits_indices if logits_indices is None else list(logits_indices)
        ctx = self.context(inp, observer)
        mode = BatchInvariantLinear() if self.batch_invariant else contextlib.nullcontext()
        with mode:
            out = self.model(
                input_ids=torch.tensor([inp.input_ids], device=self.device),
                position_ids=torch.tensor([inp.positions], device=self.device),
                attention_mask=None,
                use_cache=False,
                logits_to_keep=torch.tensor(idx, dtype=torch.long, device=self.device),
                qkv_ctx=ctx,
            )
        return out.logits[0]

    def execute(self, sched: SchedulerOutput, block_size: int) -> list[int | SamplingError]:
        """Forward the step and sample one token for every sequence that reached its end."""
        inp = build_step_inputs(sched, block_size)
        logits = self.forward(inp)
        sampling = [s.seq for s in sched.scheduled if s.samples]
        return sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
