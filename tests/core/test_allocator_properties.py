"""A hypothesis state machine over the block pool and the KV manager, checked against a model.

Random admissions (with prefix-cache hits), chunked prefill, decode, finishes, preemptions and evictions
by an outside allocation run on a small pool. After every step the invariants hold: reference counts are
>= 0 and equal the number of holders, free + held = usable, no block is both free and held, every cached
block is findable by its hash and holds exactly the tokens its hash stands for. At the end, everything
is free. 200 runs x 50 steps, derandomized so that CI runs the same cases every time.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from qkv.block_pool import NULL_BLOCK_ID, BlockPool
from qkv.kv_cache_manager import KVCacheManager, cdiv
from qkv.sampling import SamplingParams
from qkv.sequence import Sequence

BS = 4
NUM_BLOCKS = 13  # 12 usable: small enough that allocation fails and evicts often
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2]]  # shared starts make hits
PARAMS = SamplingParams(temperature=0, max_tokens=None)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.mgr = KVCacheManager(self.pool, BS)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.allocated: dict[str, int] = {}  # tokens a running sequence has slots for
        self.outside: list = []  # blocks held by an allocation outside any sequence
        self.written: dict[int, tuple[int, ...]] = {}  # block id -> the prefix its full contents stand for
        self.ids = 0

    # -- rules ------------------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 6), max_size=9))
    def add(self, prefix, tail):
        tokens = prefix + tail or [1]
        self.ids += 1
        self.waiting.append(Sequence(str(self.ids), tokens, PARAMS, BS))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), budget=st.integers(1, 12))
    def admit(self, data, budget):
        seq = data.draw(st.sampled_from(self.waiting))
        hits = self.mgr.get_computed_blocks(seq)
        for i, block in enumerate(hits):  # a hit holds exactly the tokens of this prefix
            assert self.written[block.block_id] == tuple(seq.all_token_ids[: (i + 1) * BS])
        n = min(seq.num_tokens - len(hits) * BS, budget)
        free_before = self.pool.num_free_blocks
        if self.mgr.allocate_slots(seq, n, hits):
            self.waiting.remove(seq)
            self.running.append(seq)
            self.allocated[seq.request_id] = seq.num_computed_tokens + n
            assert len(seq.blocks) == cdiv(self.allocated[seq.request_id], BS)
        else:  # a failed allocation changes nothing
            assert seq.blocks == [] and self.pool.num_free_blocks == free_before

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def compute(self, data):
        """The forward of the allocated tokens, then publish the full blocks."""
        seq = data.draw(st.sampled_from(self.running))
        end = self.allocated[seq.request_id]
        tokens = seq.all_token_ids
        for i in range(seq.num_computed_tokens // BS, cdiv(end, BS)):
            if (i + 1) * BS <= end and seq.blocks[i].block_hash is None:
                self.written[seq.blocks[i].block_id] = tuple(tokens[: (i + 1) * BS])
        seq.num_computed_tokens = end
        self.mgr.cache_blocks(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(1, 6), budget=st.integers(1, 12))
    def schedule_more(self, data, token, budget):
        """Ask for the rest of the prompt, or one decode token; preempt the sequence if blocks run out."""
        seq = data.draw(st.sampled_from(self.running))
        if seq.num_computed_tokens < self.allocated[seq.request_id]:
            return  # compute first
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.mgr.allocate_slots(seq, n):
            self.allocated[seq.request_id] = seq.num_computed_tokens + n
        else:
            self._preempt(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.mgr.free(seq)
        self.running.remove(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        self.waiting.remove(data.draw(st.sampled_from(self.waiting)))

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        """Another allocation takes blocks from the LRU end, evicting cached prefixes."""
        if n <= self.pool.num_free_blocks:
            blocks = self.pool.get_new_blocks(n)
            assert all(b.block_hash is None and b.ref_cnt == 1 for b in blocks)
            self.outside.extend(blocks)

    @precondition(lambda self: self.outside)
    @rule()
    def release_outside(self):
        self.pool.free_blocks(self.outside)
        self.outside = []

    def _preempt(self, seq):
        self.mgr.free(seq)
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        assert seq.blocks == [] and seq.num_computed_tokens == 0

    # -- invariants -----------------------------------------------------------------------------------
    @invariant()
    def accounting(self):
        pool = self.pool
        holders = {b.block_id: 0 for b in pool.blocks}
        for seq in self.running:
            for b in seq.blocks:
                holders[b.block_id] += 1
        for b in self.outside:
            holders[b.block_id] += 1
        free = pool.free_queue.ids()
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert pool.null_block.ref_cnt == 1 and NULL_BLOCK_ID not in free
        held = [b.block_id for b in pool.blocks[1:] if b.ref_cnt > 0]
        assert not set(free) & set(held)  # never both free and held
        assert pool.num_free_blocks + len(held) == pool.num_usable_blocks
        for b in pool.blocks[1:]:
            assert b.ref_cnt >= 0 and b.ref_cnt == holders[b.block_id], b

    @invariant()
    def cached_blocks_are_findable_and_right(self):
        for h, block in self.pool.cached.items():
            assert block.block_hash == h and self.pool.get_cached_block(h) is block
        for seq in self.running:  # every block a sequence published can be found by its hash
            for i in range(seq.num_cached_blocks):
                found = self.pool.get_cached_block(seq.block_hashes[i])
                assert found is not None
                assert self.written[found.block_id] == tuple(seq.all_token_ids[: (i + 1) * BS])

    def teardown(self):
        for seq in list(self.running):
            self.mgr.free(seq)
        if self.outside:
            self.pool.free_blocks(self.outside)
        self.pool.check_no_leaks()
        assert sorted(self.pool.free_queue.ids()) == list(range(1, NUM_BLOCKS))


SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_allocator_state_machine():
    # stateful_step_count is a maximum; _min_steps (Hypothesis' hook, also used by HypoFuzz) makes every one
    # of the 200 runs take all 50 steps instead of stopping early when the generated data grows.
    run_state_machine_as_test(AllocatorMachine, settings=SETTINGS, _min_steps=50)
