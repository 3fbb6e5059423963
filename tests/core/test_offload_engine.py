"""The offload tier inside the engine: a 2,048-token prefix evicted from the device comes back from the tier.

Everything is exact: 128 blocks of 3,072 bytes are stored as they are computed (write-through) and
loaded, the loaded bytes equal the bytes the prefill wrote (and those of a run without the tier), the
tokens equal the recomputed tokens, and a corrupted file is one warning and a recomputation from that block on.
"""

import logging

import pytest
from support.offload import BLOCK_BYTES_FP8, ENGINE, NUM_PREFIX_BLOCKS, PROMPT, TIER_GIB, chain, long_context_copy

from qkv import LLM, SamplingParams
from qkv.offload import CacheBlockIO, evict_free_blocks
from qkv.offload_files import HEADER, SUFFIX, check_entry

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
HASHES = chain(PROMPT)


@pytest.fixture(scope="module")
def model(tiny_dir, tmp_path_factory):
    return str(long_context_copy(tiny_dir("llama"), tmp_path_factory.mktemp("offload") / "tiny-4k"))


@pytest.fixture(scope="module")
def recomputed(model):
    """Tokens and prefix-block bytes of a run without any tier: what a tier hit must reproduce."""
    llm = LLM(model, **ENGINE)
    tokens = llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids
    return tokens, prefix_bytes(llm.llm_engine)


def prefix_bytes(engine) -> list[bytes]:
    """The device bytes of the prompt's 128 cached prefix blocks, in chain order."""
    blocks = [engine.pool.get_cached_block(h) for h in HASHES]
    assert None not in blocks
    return CacheBlockIO(engine.cache).gather([b.block_id for b in blocks])


def offload_llm(model: str, tier_dir=None) -> LLM:
    extra = {"kv_offloading_dir": str(tier_dir)} if tier_dir is not None else {}
    return LLM(model, **ENGINE, kv_offloading_size=TIER_GIB, **extra)


def cold_then_evicted(llm: LLM) -> list[int]:
    """Prefill the prompt once (the tier stores its blocks as they are computed), then evict every free
    cached block from the device; returns the tokens."""
    engine = llm.llm_engine
    tokens = llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids
    assert engine.offload.flush() == 0  # a file tier's writer has written every file
    assert None not in [engine.pool.get_cached_block(h) for h in HASHES]  # still on the device, and stored
    assert engine.offload.counters()["kv_offload_stored_blocks"] == NUM_PREFIX_BLOCKS
    evict_free_blocks(engine.pool)
    assert [engine.pool.get_cached_block(h) for h in HASHES] == [None] * NUM_PREFIX_BLOCKS
    c = engine.offload.counters()
    assert (c["kv_offload_stored_blocks"], c["kv_offload_entries"]) == (NUM_PREFIX_BLOCKS, NUM_PREFIX_BLOCKS)
    assert c["kv_offload_bytes_written"] == NUM_PREFIX_BLOCKS * BLOCK_BYTES_FP8
    header = HEADER.size if engine.config.kv_offloading_dir else 0  # a file's 84-byte header counts too
    assert c["kv_offload_used_bytes"] == NUM_PREFIX_BLOCKS * (BLOCK_BYTES_FP8 + header)
    return tokens


@pytest.mark.parametrize("backend", ["ram", "file"])
def test_evicted_prefix_is_a_tier_hit_with_bit_exact_bytes(model, recomputed, tmp_path, backend):
    llm = offload_llm(model, tmp_path / "tier" if backend == "file" else None)
    engine, offload = llm.llm_engine, llm.llm_engine.offload
    assert offload.io.block_bytes == BLOCK_BYTES_FP8
    assert cold_then_evicted(llm) == recomputed[0]
    if backend == "file":
        assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == sorted(
            offload.key(h).hex() + SUFFIX for h in HASHES
        )
    stored = [offload.tier.get(offload.key(h)) for h in HASHES]

    again = llm.generate(PROMPT, PARAMS)[0]
    assert again.outputs[0].token_ids == recomputed[0]
    c = offload.counters()
    assert (c["external_prefix_cache_queries"], c["external_prefix_cache_hits"]) == (2 * len(PROMPT), 2048)
    assert (c["kv_offload_loaded_blocks"], c["kv_offload_bad_entries"]) == (NUM_PREFIX_BLOCKS, 0)
    assert c["kv_offload_bytes_read"] == 2 * NUM_PREFIX_BLOCKS * BLOCK_BYTES_FP8  # the reads above, then the load
    assert engine.stats.prefix_cache_hits == 2048  # the scheduler saw ordinary prefix hits
    loaded = prefix_bytes(engine)
    assert loaded == stored == recomputed[1]  # bit-exact: tier payloads, device blocks, a run without a tier
    engine.pool.check_no_leaks()


def test_corrupted_entry_is_recomputed_with_one_warning(model, recomputed, tmp_path, caplog):
    llm = offload_llm(model, tmp_path)
    offload = llm.llm_engine.offload
    cold_then_evicted(llm)
    bad = tmp_path / (offload.key(HASHES[64]).hex() + SUFFIX)  # the 65th block of 128
    data = bad.read_bytes()
    bad.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))

    with caplog.at_level(logging.WARNING, logger="qkv"):
        out = llm.generate(PROMPT, PARAMS)[0]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"KV offload entry {bad} is corrupt (payload checksum mismatch): dropped; its blocks will be recomputed"
    ]
    assert out.outputs[0].token_ids == recomputed[0]
    c = offload.counters()
    assert (c["external_prefix_cache_hits"], c["kv_offload_loaded_blocks"], c["kv_offload_bad_entries"]) == (
        64 * 16,
        64,
        1,
    )
    assert llm.llm_engine.stats.prefix_cache_hits == 64 * 16
    # of the recomputed blocks 65..128, the tier lacked only the 65th: stored again, the bad file is now a good one
    assert offload.flush() == 0 and c["kv_offload_stored_blocks"] == NUM_PREFIX_BLOCKS + 1
    assert check_entry(bad.read_bytes(), offload.key(HASHES[64])) is None
    assert bad.read_bytes()[HEADER.size :] == recomputed[1][64]
    assert prefix_bytes(llm.llm_engine)[:64] == recomputed[1][:64]  # the loaded blocks, bit for bit
    llm.llm_engine.pool.check_no_leaks()
