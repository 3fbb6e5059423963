"""Block accounting in the style of vLLM's test_block_pool.py / test_prefix_caching.py: exact ids."""

import pytest

from qkv.block_pool import BlockPool, hash_block_tokens
from qkv.kv_cache_manager import KVCacheManager
from qkv.sampling import SamplingParams
from qkv.sequence import Sequence

BS = 4


def seq(rid, tokens, max_tokens=8):
    return Sequence(str(rid), tokens, SamplingParams(temperature=0, max_tokens=max_tokens), BS)


def test_free_list_order_and_null_block():
    pool = BlockPool(6)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    assert pool.free_queue.ids() == [1, 2, 3, 4, 5]
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2] and all(b.ref_cnt == 1 for b in a)
    b = pool.get_new_blocks(3)
    assert [x.block_id for x in b] == [3, 4, 5] and pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(a))  # a sequence frees tail first
    assert pool.free_queue.ids() == [2, 1]
    pool.free_blocks(b)
    assert pool.free_queue.ids() == [2, 1, 3, 4, 5]
    pool.check_no_leaks()


def test_free_queue_remove_from_middle_is_o1_and_keeps_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)
    pool.free_queue.remove(pool.blocks[3])
    assert pool.free_queue.ids() == [1, 2, 4, 5] and pool.free_queue.num_free == 4
    pool.free_queue.append(pool.blocks[3])
    assert pool.free_queue.ids() == [1, 2, 4, 5, 3]


def test_chained_hash_depends_on_prefix():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) == hash_block_tokens(h1, (5, 6, 7, 8))


def test_prefix_hit_shares_blocks_and_refcounts():
    pool = BlockPool(10)
    mgr = KVCacheManager(pool, BS)
    a = seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert mgr.get_computed_blocks(a) == []
    assert mgr.allocate_slots(a, 10)
    assert a.block_ids == [1, 2, 3]
    a.num_computed_tokens = 10
    mgr.cache_blocks(a)
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]

    b = seq("b", list(range(8)) + [99, 98, 97])  # shares the first two blocks
    hits = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2]
    assert mgr.allocate_slots(b, 3, hits)
    assert b.block_ids == [1, 2, 4] and b.num_computed_tokens == 8
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]

    mgr.free(a)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 0]
    assert pool.free_queue.ids() == [5, 6, 7, 8, 9, 3]
    mgr.free(b)
    # b frees tail first: 4, then its shared prefix 2, 1 (a's copies were already released)
    assert pool.free_queue.ids() == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    pool.check_no_leaks()
    assert len(pool.cached) == 2  # blocks 1, 2 are free but still cached


def test_fully_cached_prompt_recomputes_last_block():
    pool = BlockPool(10)
    mgr = KVCacheManager(pool, BS)
    a = seq("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    mgr.cache_blocks(a)
    mgr.free(a)
    b = seq("b", list(range(8)))
    hits = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1]  # the last token must be computed for logits
    assert mgr.allocate_slots(b, 4, hits)
    assert b.block_ids == [1, 3] and b.num_computed_tokens == 4


def test_lru_eviction_order():
    pool = BlockPool(5)
    mgr = KVCacheManager(pool, BS)
    seqs = []
    for i, base in enumerate((0, 100)):
        s = seq(i, list(range(base, base + 8)))
        mgr.allocate_slots(s, 8)
        s.num_computed_tokens = 8
        mgr.cache_blocks(s)
        seqs.append(s)
    assert [s.block_ids for s in seqs] == [[1, 2], [3, 4]]
    mgr.free(seqs[0])  # queue: 2, 1
    mgr.free(seqs[1])  # queue: 2, 1, 4, 3
    assert pool.free_queue.ids() == [2, 1, 4, 3]
    # a hit on seq 1's first block pulls block 3 out of the queue
    c = seq("c", list(range(100, 104)) + [7, 7, 7, 7, 7])
    hits = mgr.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [3]
    assert mgr.allocate_slots(c, 5, hits)
    # new blocks come from the LRU end and lose their cached hashes
    assert c.block_ids == [3, 2, 1]
    assert pool.blocks[2].block_hash is None and pool.blocks[1].block_hash is None
    assert pool.free_queue.ids() == [4]
    assert set(pool.cached.values()) == {pool.blocks[3], pool.blocks[4]}
    mgr.free(c)
    pool.check_no_leaks()


def test_allocation_failure_changes_nothing():
    pool = BlockPool(4)
    mgr = KVCacheManager(pool, BS)
    a = seq("a", list(range(20)))
    assert not mgr.allocate_slots(a, 20)  # needs 5, only 3 usable
    assert a.blocks == [] and pool.num_free_blocks == 3


def test_free_cached_hit_not_double_counted():
    """A hit on a free block must not also be counted as allocatable."""
    pool = BlockPool(3)  # blocks 1, 2
    mgr = KVCacheManager(pool, BS)
    a = seq("a", list(range(5)))
    mgr.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    mgr.cache_blocks(a)
    mgr.free(a)
    b = seq("b", list(range(4)) + [50] * 8)  # hit block 1, then needs 2 more blocks: only 1 left
    hits = mgr.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1]
    assert not mgr.allocate_slots(b, 8, hits)
    assert pool.num_free_blocks == 2 and pool.blocks[1].ref_cnt == 0
