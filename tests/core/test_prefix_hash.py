"""Prefix-cache block hashes: SHA-256 over a canonical encoding, and per-request ``cache_salt`` isolation.

The two blocks below collide under the old key, Python's ``hash((parent, tuple(tokens)))``; they were
found with ``scripts/find_block_hash_collision.py`` (vLLM advisory GHSA-rm76-4mrf-v9r8). With that key a
request could attend over another request's KV blocks; with SHA-256 it cannot.
"""

import hashlib
import struct

import pytest

from qkv import LLM, SamplingParams
from qkv.block_pool import BlockPool, hash_block_tokens
from qkv.kv_cache_manager import KVCacheManager
from qkv.sequence import Sequence

BS = 16
COLLIDE_A = [1492, 1283, 4, 504, 3575, 282, 4649, 314, 2, 504, 3575, 282, 4649, 314, 2, 41919]
COLLIDE_B = [3186, 2009, 4, 504, 3575, 282, 4649, 314, 2, 504, 3575, 282, 4649, 314, 2, 0]
PARAMS = SamplingParams(temperature=0, max_tokens=4)


def old_hash(parent, token_ids, extra_keys=b"", algo="sha256"):
    """qkv's block key before SHA-256 (same signature as ``hash_block_tokens``, extras ignored)."""
    return hash((parent, tuple(token_ids)))


def seq(rid, tokens, salt=None):
    return Sequence(rid, tokens, PARAMS, BS, cache_salt=salt)


def computed(mgr, s):
    """Allocate, 'compute' and publish every full block of ``s``."""
    assert mgr.allocate_slots(s, s.num_tokens, mgr.get_computed_blocks(s))
    s.num_computed_tokens = s.num_tokens
    mgr.cache_blocks(s)


def test_the_blocks_collide_under_the_builtin_hash_only():
    assert COLLIDE_A != COLLIDE_B and all(0 <= t < 49152 for t in COLLIDE_A + COLLIDE_B)  # SmolLM2 vocab
    assert old_hash(None, COLLIDE_A) == old_hash(None, COLLIDE_B)
    tail = list(range(100, 116))  # chaining keeps the collision going: every later block collides too
    assert old_hash(old_hash(None, COLLIDE_A), tail) == old_hash(old_hash(None, COLLIDE_B), tail)
    assert hash_block_tokens(None, COLLIDE_A) != hash_block_tokens(None, COLLIDE_B)


def test_a_colliding_block_is_a_prefix_hit_under_the_old_hash(monkeypatch):
    """The attack the old key allowed: B's request gets A's KV block."""
    import qkv.sequence

    monkeypatch.setattr(qkv.sequence, "hash_block_tokens", old_hash)
    mgr = KVCacheManager(BlockPool(10), BS)
    computed(mgr, seq("a", COLLIDE_A + [7]))
    assert [b.block_id for b in mgr.get_computed_blocks(seq("b", COLLIDE_B + [7]))] == [1]


def test_a_colliding_block_is_no_prefix_hit_under_sha256():
    mgr = KVCacheManager(BlockPool(10), BS)
    computed(mgr, seq("a", COLLIDE_A + [7]))
    assert mgr.get_computed_blocks(seq("b", COLLIDE_B + [7])) == []
    assert [b.block_id for b in mgr.get_computed_blocks(seq("c", COLLIDE_A + [9]))] == [1]  # a real hit


def test_encoding_is_canonical_sha256():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h.hex() == "b3c8d905621786d6e51ba74b1608961aebc5e8fe2e181da8b4fc77d2c6141575"
    assert h == hashlib.sha256(bytes(32) + struct.pack(">I4Q", 4, 1, 2, 3, 4) + struct.pack(">I", 0)).digest()
    salted = hash_block_tokens(None, [1, 2, 3, 4], b"tenant-a")
    assert salted.hex() == "70879905be36a0d56004112c64122bec66e9fb25115e401ab4246f809aab27dd"
    child = hash_block_tokens(h, [5, 6])
    assert child == hashlib.sha256(h + struct.pack(">I2Q", 2, 5, 6) + struct.pack(">I", 0)).digest()
    # length prefixes keep it injective: moving bytes between tokens and extras changes the hash
    assert hash_block_tokens(None, [1], b"") != hash_block_tokens(None, [], struct.pack(">Q", 1))
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of sha256, got 'xxhash'"):
        hash_block_tokens(None, [1], algo="xxhash")


def test_cache_salt_isolates_the_whole_prefix():
    tokens = list(range(40))  # two full blocks and 8 tokens
    plain, a1, a2, b = seq("p", tokens), seq("a1", tokens, "a"), seq("a2", tokens, "a"), seq("b", tokens, "b")
    assert len({plain.block_hashes[0], a1.block_hashes[0], b.block_hashes[0]}) == 3
    assert len({plain.block_hashes[1], a1.block_hashes[1], b.block_hashes[1]}) == 3  # salt reaches block 2
    assert a1.block_hashes == a2.block_hashes
    mgr = KVCacheManager(BlockPool(20), BS)
    computed(mgr, a1)
    assert mgr.get_computed_blocks(plain) == [] and mgr.get_computed_blocks(b) == []
    assert [x.block_id for x in mgr.get_computed_blocks(a2)] == [1, 2]


def test_engine_cache_salt(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=40)
    engine = llm.llm_engine
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks can hit

    def run(salt):
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out

    first = run("tenant-a")
    assert first.num_cached_tokens == 0
    assert run("tenant-a").num_cached_tokens == 32
    other = run("tenant-b")
    assert other.num_cached_tokens == 0 and run(None).num_cached_tokens == 0
    assert other.outputs[0].token_ids == first.outputs[0].token_ids  # isolation changes no output
    for bad in ("", 5):
        with pytest.raises(ValueError, match=f"cache_salt must be a non-empty string or None, got {bad!r}"):
            engine.add_request(prompt, PARAMS, cache_salt=bad)
    engine.pool.check_no_leaks()
