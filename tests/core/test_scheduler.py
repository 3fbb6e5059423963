"""The scheduler alone (no model): token budget, chunked prefill, admission and preemption order, exact ids.

Built from small factories in the style of vLLM's scheduler tests: a pool of a few 4-token blocks, sequences
named by letters, and :func:`run_step`, which does what the engine does after a forward (the chunk's tokens
are computed; a chunk that reaches the end of the known tokens samples one more).
"""

import pytest

from qkv.block_pool import BlockPool
from qkv.kv_cache_manager import KVCacheManager
from qkv.sampling import SamplingParams
from qkv.scheduler import Scheduler
from qkv.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(rid: str, num_tokens: int, first: int = 0, max_tokens: int = 8) -> Sequence:
    return Sequence(
        rid, list(range(first, first + num_tokens)), SamplingParams(temperature=0, max_tokens=max_tokens), BS
    )


def make_scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64, caching: bool = False) -> Scheduler:
    return Scheduler(KVCacheManager(BlockPool(num_blocks, caching), BS, caching), max_num_seqs, budget)


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and apply it as the engine would (computed tokens, full blocks cached, a sampled
    token); returns (request id, tokens) in schedule order."""
    out = sched.schedule()
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.kv.cache_blocks(item.seq)
        if samples:
            item.seq.append_token(1000 + item.seq.num_tokens)
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def test_chunked_prefill_and_budget():
    pool = BlockPool(20)
    sched = Scheduler(KVCacheManager(pool, BS), max_num_seqs=4, max_num_batched_tokens=6)
    a, b = make_seq("a", 10), make_seq("b", 3, first=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 6, False)]
    a.num_computed_tokens += 6
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 4, True), ("b", 2, False)]


def test_preempts_newest_and_frees_its_blocks():
    pool = BlockPool(5)  # 4 usable blocks
    mgr = KVCacheManager(pool, BS, enable_prefix_caching=False)
    sched = Scheduler(mgr, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq("a", 8), make_seq("b", 8, first=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    for s in (a, b):
        s.num_computed_tokens = 8
        s.append_token(1)
    assert a.block_ids == [1, 2] and b.block_ids == [3, 4]
    out = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    assert a.block_ids == [1, 2, 4] and b.blocks == [] and b.num_computed_tokens == 0
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert sched.num_preemptions == 1
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    pool.check_no_leaks()


def test_token_budget_serves_decodes_first_then_chunks_the_waiting_prefill():
    sched = make_scheduler(40, budget=8)
    for rid in "abc":
        sched.add(make_seq(rid, 3, first=10 * ord(rid)))
    assert run_step(sched) == [("a", 3), ("b", 3), ("c", 2)]  # c's prompt is cut by the budget
    sched.add(make_seq("d", 14, first=500))
    # a and b decode (one token each), c finishes its prompt, d takes what is left: 8 - 1 - 1 - 1 = 5
    assert run_step(sched) == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]
    assert run_step(sched) == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]
    assert run_step(sched) == [("a", 1), ("b", 1), ("c", 1), ("d", 4)]  # d's last chunk samples
    assert [s.num_tokens for s in sched.running] == [7, 7, 6, 15]


@pytest.mark.parametrize("budget,chunks", [(16, [16, 16, 8]), (7, [7] * 5 + [5]), (40, [40]), (1, [1] * 40)])
def test_a_long_prompt_is_prefilled_in_budget_sized_chunks(budget, chunks):
    sched = make_scheduler(16, budget=budget)
    seq = make_seq("a", 40)
    sched.add(seq)
    got = [run_step(sched)[0][1] for _ in chunks]
    assert got == chunks and seq.num_tokens == 41 and seq.num_computed_tokens == 40
    assert seq.block_ids == list(range(1, 11))  # 10 blocks of 4 tokens, in free-list order


def test_max_num_seqs_caps_admission_in_arrival_order():
    sched = make_scheduler(40, max_num_seqs=2)
    for rid in "abcd":
        sched.add(make_seq(rid, 2, first=10 * ord(rid)))
    assert run_step(sched) == [("a", 2), ("b", 2)]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    sched.finish(sched.running[0], SequenceStatus.FINISHED_STOPPED)  # a leaves: c takes its place
    assert run_step(sched) == [("b", 1), ("c", 2)]
    assert [s.request_id for s in sched.running] == ["b", "c"] and [s.request_id for s in sched.waiting] == ["d"]


def test_preemption_order_newest_first_and_recompute_from_the_front():
    # 6 usable blocks of 4: a, b, c each hold 8 tokens (2 blocks); the next decode needs a third block each
    sched = make_scheduler(7)
    seqs = {rid: make_seq(rid, 8, first=100 * i) for i, rid in enumerate("abc")}
    for s in seqs.values():
        sched.add(s)
    assert run_step(sched) == [("a", 8), ("b", 8), ("c", 8)]
    assert [seqs[r].block_ids for r in "abc"] == [[1, 2], [3, 4], [5, 6]]
    out = sched.schedule()  # a's 9th token needs a block: c (newest) goes; b's needs one: c's freed pair covers it
    assert [s.request_id for s in out.preempted] == ["c"]
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 1)]
    assert seqs["a"].block_ids == [1, 2, 6] and seqs["b"].block_ids == [3, 4, 5]
    assert [s.request_id for s in sched.waiting] == ["c"] and seqs["c"].num_computed_tokens == 0
    for item in out.scheduled:
        item.seq.num_computed_tokens += 1
        item.seq.append_token(7)
    # nothing else is admitted while blocks are short; when a finishes, c is recomputed from its first token
    sched.finish(seqs["a"], SequenceStatus.FINISHED_STOPPED)
    assert run_step(sched) == [("b", 1), ("c", 9)]  # c's prompt and the token it had sampled
    assert seqs["c"].block_ids == [6, 2, 1] and sched.num_preemptions == 1


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(5)  # 4 usable blocks
    a, b = make_seq("a", 8), make_seq("b", 4, first=50)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("a", 8), ("b", 4)]
    sched.add(make_seq("c", 1, first=90))
    out = sched.schedule()  # a's decode needs a 3rd block, b's a 2nd: b is preempted, and c must wait
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]


def test_prefix_hits_are_admitted_with_only_their_tail_scheduled():
    sched = make_scheduler(20, caching=True)
    a = make_seq("a", 10)
    sched.add(a)
    assert run_step(sched) == [("a", 10)]
    assert a.block_ids == [1, 2, 3]
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)  # its 2 full blocks stay cached
    b = make_seq("b", 13)  # the same first 10 tokens, then 3 more
    sched.add(b)
    assert run_step(sched) == [("b", 5)]  # 8 tokens (2 blocks) hit; tokens 8..12 are computed
    # 13 tokens need 4 blocks: the 2 hits, then new ones from the free list's head (a's freed block 3 is at its tail)
    assert b.block_ids == [1, 2, 4, 5] and b.metrics.num_cached_tokens == 8
