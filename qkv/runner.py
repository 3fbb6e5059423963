"""Turn a scheduled step into one flattened forward pass and sample from it.

All sequences of a step are concatenated into a single batch of one row
(``input_ids [1, T]``) with explicit ``position_ids``; each sequence's slice of
the row is described by ``query_start_loc`` and ``seq_lens`` (vLLM's varlen
metadata), and its cache by a block table. Only the rows that need a next
token, and the prompt positions whose logprobs were asked for, produce logits
(``logits_to_keep`` with indices). The engine samples from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .attention import StepContext
from .compiled import CompiledModel
from .kernels.cpu_attention import CpuKernels
from .kernels.paged import AttentionBackend, StepMetadata
from .kv_cache import KVCache
from .scheduler import SchedulerOutput

__all__ = ["ModelRunner", "StepInputs", "StepLogits", "build_step_inputs"]


class StepInputs:
    """Host-built tensors of one step (kept separate so tests can check them exactly)."""

    def __init__(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_start_loc: list[int],
        logits_indices: list[int],
        sample_rows: list[int | None] | None = None,
        prompt_rows: list[tuple[int, int, range]] | None = None,
    ) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.query_start_loc = query_start_loc
        self.logits_indices = logits_indices
        # Per scheduled item: its row among the logits (None: it does not sample this step).
        self.sample_rows = sample_rows if sample_rows is not None else []
        # (item index, first row among the logits, the prompt positions those rows are) for prompt logprobs.
        self.prompt_rows = prompt_rows if prompt_rows is not None else []


@dataclass
class StepLogits:
    """What one forward produced: ``logits`` rows, and which item and position each row is."""

    logits: torch.Tensor
    inputs: StepInputs
    #: ``argmax(logits, rows)``: the rows' fp32 argmax in one kernel call (:meth:`CpuKernels.argmax_rows`), or
    #: None for torch's
    argmax: Callable[[torch.Tensor, list[int]], list[int]] | None = None

    def sample_row(self, item: int) -> torch.Tensor | None:
        row = self.inputs.sample_rows[item]
        return None if row is None else self.logits[row]

    @cached_property
    def _argmax(self) -> dict[int, int]:
        rows = [r for r in self.inputs.sample_rows if r is not None]  # not the prompt-logprob rows
        if self.argmax is not None:
            return dict(zip(rows, self.argmax(self.logits, rows)))
        picks = self.logits[rows].to(torch.float32).argmax(dim=-1).tolist() if rows else []
        return dict(zip(rows, picks))

    def greedy_token(self, item: int) -> int:
        """The fp32 argmax of ``item``'s sample row, the sampler's greedy pick: computed for all the step's sample
        rows in one call, since one call per request costs a thread-pool dispatch per request."""
        row = self.inputs.sample_rows[item]
        assert row is not None, "the item does not sample this step"
        return self._argmax[row]


def build_step_inputs(sched: SchedulerOutput, block_size: int) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    qsl = [0]
    logits_indices: list[int] = []
    sample_rows: list[int | None] = []
    prompt_rows: list[tuple[int, int, range]] = []
    for i, item in enumerate(sched.scheduled):
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        tokens = seq.all_token_ids
        ids = seq.block_ids
        input_ids.extend(tokens[start : start + n])
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        tables.append(ids)
        seq_lens.append(start + n)
        scored = seq.prompt_logprob_positions(start, n)
        if scored:
            prompt_rows.append((i, len(logits_indices), scored))
            logits_indices.extend(qsl[-1] + p - start for p in scored)
        qsl.append(qsl[-1] + n)
        sample_rows.append(len(logits_indices) if item.samples else None)
        if item.samples:
            logits_indices.append(qsl[-1] - 1)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]  # pad with the null block
    return StepInputs(input_ids, positions, slots, tables, seq_lens, qsl, logits_indices, sample_rows, prompt_rows)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        linear_modes: Sequence[Callable[[], contextlib.AbstractContextManager]] = (),
        compile_model: bool = False,
    ) -> None:
        """``linear_modes``: factories of the contexts every forward runs under, entered in order (the last
        one sees a linear call first): how the linears multiply (qkv.cpu_linear, qkv.batch_invariant).
        ``compile_model``: run the decoder under ``torch.compile`` (:mod:`qkv.compiled`), compiled here, before
        the first step; where that fails the runner warns once and stays eager."""
        self.model = model
        self.linear_modes = tuple(linear_modes)
        self.cache = cache
        self.backend = backend
        self.device = device
        # greedy picks on the CPU kernels where they run the step: torch's argmax over bf16 rows is slow there
        self.argmax = backend.argmax_rows if isinstance(backend, CpuKernels) and device.type == "cpu" else None
        self.compiled: CompiledModel | None = None
        if compile_model:
            self.compiled = CompiledModel(model)
            self.compiled.warm_up(self._warm_up_step)
            if not self.compiled.ok:
                self.compiled = None

    def _warm_up_step(self, tokens: int) -> None:
        """One forward of ``tokens`` dummy tokens of one sequence, written into the last block (free at start-up,
        and overwritten before any sequence reads it), so that compiling happens before the first request."""
        bs, last = self.cache.block_size, self.cache.num_blocks - 1
        blocks = [last] * -(-tokens // bs)
        slots = [last * bs + t % bs for t in range(tokens)]
        inp = StepInputs([0] * tokens, list(range(tokens)), slots, [blocks], [tokens], [0, tokens], [tokens - 1])
        self.forward(inp)

    def context(self, inp: StepInputs, observer=None) -> StepContext:
        """The step's attention metadata, built once here from the host lists; every layer reads it."""
        meta = StepMetadata.build(inp.slot_mapping, inp.block_tables, inp.seq_lens, inp.query_start_loc, self.device)
        return StepContext(cache=self.cache, backend=self.backend, meta=meta, observer=observer)

    @torch.inference_mode()
    def forward(self, inp: StepInputs, logits_indices: list[int] | None = None, observer=None) -> torch.Tensor:
        """Run the model over the flattened step; returns logits for ``logits_indices`` rows.

        ``logits_indices=None`` uses the sampling rows; pass ``range(T)`` to get
        every position (perplexity evaluation).
        """
        idx = inp.logits_indices if logits_indices is None else list(logits_indices)
        ctx = self.context(inp, observer)
        with contextlib.ExitStack() as modes:
            for make in self.linear_modes:
                modes.enter_context(make())
            if self.compiled is not None:
                return self.compiled(
                    ctx,
                    torch.tensor([inp.input_ids], device=self.device),
                    torch.tensor([inp.positions], device=self.device),
                    torch.tensor(idx, dtype=torch.long, device=self.device),
                )
            out = self.model(
                input_ids=torch.tensor([inp.input_ids], device=self.device),
                position_ids=torch.tensor([inp.positions], device=self.device),
                attention_mask=None,
                use_cache=False,
                logits_to_keep=torch.tensor(idx, dtype=torch.long, device=self.device),
                qkv_ctx=ctx,
            )
        return out.logits[0]

    def execute(self, sched: SchedulerOutput, block_size: int) -> StepLogits:
        """Do the step's copy-on-write block copies, then its forward; the engine samples from the logits."""
        src_dst = sched.block_copies
        self.cache.copy_blocks([s for s, _ in src_dst], [d for _, d in src_dst])
        inp = build_step_inputs(sched, block_size)
        return StepLogits(self.forward(inp), inp, self.argmax)
