"""The model runner: one flattened row per step, and attention metadata built once per step.

* :func:`build_step_inputs` for a mixed step (a prefill chunk over a cached prefix, a decode, a whole short
  prompt): exact input ids, positions, slots, padded block tables, lengths and logits rows.
* One forward of a 30-layer model builds its :class:`~qkv.kernels.paged.StepMetadata` once, and the 60
  per-layer back-end calls (a write and an attention per layer) make no host synchronization: no
  ``Tensor.item``, ``tolist``, ``bool``, ``int`` or ``float`` of a tensor.
"""

import contextlib

import pytest
import torch

from qkv import LLM, SamplingParams
from qkv.block_pool import BlockPool
from qkv.kernels.paged import StepMetadata
from qkv.kv_cache_manager import KVCacheManager
from qkv.runner import StepLogits, build_step_inputs
from qkv.scheduler import ScheduledSeq, SchedulerOutput
from qkv.sequence import Sequence

BS = 4


def make_seq(rid: str, tokens: list[int], logprobs: int | None = None) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=logprobs)
    return Sequence(rid, tokens, params, BS)


def test_mixed_prefill_and_decode_step_inputs():
    mgr = KVCacheManager(BlockPool(16, False), BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(100, 110)))  # 10 tokens: 6 computed, a chunk of 4 now
    b = make_seq("b", list(range(200, 209)))  # 9 tokens computed, its sampled 10th decodes now
    c = make_seq("c", [300, 301, 302], logprobs=0)  # a whole short prompt, with prompt logprobs
    assert mgr.allocate_slots(a, 6) and mgr.allocate_slots(b, 9)
    a.num_computed_tokens, b.num_computed_tokens = 6, 9
    b.append_token(209)
    assert mgr.allocate_slots(a, 4) and mgr.allocate_slots(b, 1) and mgr.allocate_slots(c, 3)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([1, 2, 6], [3, 4, 5], [7])
    inp = build_step_inputs(SchedulerOutput([ScheduledSeq(a, 4), ScheduledSeq(b, 1), ScheduledSeq(c, 3)]), BS)
    assert inp.input_ids == [106, 107, 108, 109, 209, 300, 301, 302]
    assert inp.positions == [6, 7, 8, 9, 9, 0, 1, 2]
    # slot = block * 4 + offset: a's positions 6, 7 in block 2, 8, 9 in block 6; b's 9 in block 5; c's in 7
    assert inp.slot_mapping == [10, 11, 24, 25, 21, 28, 29, 30]
    assert inp.block_tables == [[1, 2, 6], [3, 4, 5], [7, 0, 0]]  # padded with the null block
    assert inp.seq_lens == [10, 10, 3] and inp.query_start_loc == [0, 4, 5, 8]
    # a and b sample from their last row; c scores prompt tokens 1 and 2 (rows 5, 6) and samples from row 7
    assert inp.logits_indices == [3, 4, 5, 6, 7] and inp.sample_rows == [0, 1, 4]
    assert inp.prompt_rows == [(2, 2, range(0, 2))]
    meta = StepMetadata.build(inp.slot_mapping, inp.block_tables, inp.seq_lens, inp.query_start_loc)
    assert meta.num_tokens == 8 and meta.max_q_len == 4 and meta.q_lens_host == (4, 1, 3)
    assert meta.write_rows is None and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.tolist() == inp.slot_mapping and meta.seq_lens.tolist() == [10, 10, 3]


SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_syncs(counts: dict[str, int]):
    """Count the Tensor methods that read a value back to the host while ``counts['active']`` is set."""
    saved = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def spy(name):
        def method(self, *args, **kwargs):
            if counts["active"]:
                counts[name] = counts.get(name, 0) + 1
            return saved[name](self, *args, **kwargs)

        return method

    for name in SYNCS:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_one_metadata_build_and_no_host_sync_per_layer(tiny_dir, monkeypatch, backend):
    path = str(tiny_dir("llama_30"))
    llm = LLM(path, dtype="float32", num_blocks=64, attention_backend=backend)
    engine = llm.llm_engine
    assert len(engine.cache.layers) == 30
    builds = []
    original = StepMetadata.build.__func__

    def counting_build(cls, *args, **kwargs):
        builds.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(StepMetadata, "build", classmethod(counting_build))
    counts = {"active": False, "calls": 0}
    real = engine.backend

    class Spy:  # the engine's back end, with the host reads inside its per-layer calls counted
        name = real.name

        def prepare(self, layer):
            real.prepare(layer)

        def _counted(self, fn, *args):
            counts["active"], counts["calls"] = True, counts["calls"] + 1
            try:
                return fn(*args)
            finally:
                counts["active"] = False

        def write(self, *args):
            return self._counted(real.write, *args)

        def attend(self, *args):
            return self._counted(real.attend, *args)

    engine.runner.backend = Spy()
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with count_syncs(counts):
        engine.add_request([5 + i for i in range(37)], sp)
        engine.step()  # its prefill
        engine.add_request([60 + i for i in range(9)], sp)
        builds.clear()
        counts["calls"] = 0
        engine.step()  # a mixed step: the first request's decode and the second one's prefill
    assert builds == [1] and counts["calls"] == 60
    assert {k: v for k, v in counts.items() if k not in ("active", "calls")} == {}
    while engine.has_unfinished_requests():
        engine.step()
    engine.pool.check_no_leaks()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_picks_come_from_the_cpu_kernel_and_equal_torchs(tiny_dir, backend):
    """On the CPU kernels the step's greedy tokens come from ``CpuKernels.argmax_rows`` (one call for all its
    sample rows, never the prompt-logprob rows); elsewhere from torch. Either way they are the fp32 argmax."""
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=64, attention_backend=backend)
    runner = llm.llm_engine.runner
    assert (runner.argmax is not None) == (backend == "cpu")
    mgr = KVCacheManager(BlockPool(16, False), BS, enable_prefix_caching=False)
    a, c = make_seq("a", [1, 2, 3]), make_seq("c", [4, 5, 6], logprobs=0)
    assert mgr.allocate_slots(a, 3) and mgr.allocate_slots(c, 3)
    inp = build_step_inputs(SchedulerOutput([ScheduledSeq(a, 3), ScheduledSeq(c, 3)]), BS)
    assert inp.sample_rows == [0, 3]  # rows 1 and 2 score c's prompt
    logits = torch.zeros(4, 37, dtype=torch.bfloat16)
    logits[0, 36], logits[1, 5], logits[2, 6], logits[3, 9], logits[3, 30] = 1.0, 9.0, 9.0, 2.0, 2.0
    calls = []

    def counted(x, rows):
        calls.append(rows)
        return runner.argmax(x, rows)

    step = StepLogits(logits, inp, counted if runner.argmax is not None else None)
    assert [step.greedy_token(0), step.greedy_token(1)] == [36, 9]  # c's tie: the first
    assert calls == ([[0, 3]] if backend == "cpu" else [])
