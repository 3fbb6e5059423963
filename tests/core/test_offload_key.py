"""The tier key covers everything that decides a block's bytes, and nothing that does not.

``key = sha256(namespace || block hash)``: the namespace changes with the model, the cache dtype, the
rotation, every static scale byte and a 4-bit cache's calibration; the block hash with every token and the
request's ``cache_salt``.
The same configuration started twice gets the same namespace, which is what lets a file tier serve a
restarted server.
"""

import torch
from support.offload import chain, long_context_copy

from qkv import LLM, SamplingParams
from qkv.offload import evict_free_blocks, namespace_digest

SMALL = dict(dtype="float32", num_blocks=12, max_model_len=128)
PROMPT = [(5 * i) % 300 + 3 for i in range(48)] + [7, 8, 9]  # 3 full blocks, then 3 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def digest(model: str, **kw) -> bytes:
    engine = LLM(model, **SMALL, **kw).llm_engine
    return namespace_digest(engine.model_path, engine.dtype, engine.cache)


def test_namespace_covers_model_dtype_rotation_and_scales(tiny_dir, tmp_path):
    tiny = str(tiny_dir("llama"))
    fp8 = LLM(tiny, **SMALL, kv_cache_dtype="fp8").llm_engine
    base = namespace_digest(fp8.model_path, fp8.dtype, fp8.cache)
    assert digest(tiny, kv_cache_dtype="fp8") == base  # a restart with the same flags: the same keys
    others = {
        "auto": digest(tiny),
        "int8_per_token_head": digest(tiny, kv_cache_dtype="int8_per_token_head"),
        "fp8+hadamard": digest(tiny, kv_cache_dtype="fp8", kv_rotation="hadamard"),
        "other model": digest(str(long_context_copy(tiny_dir("llama"), tmp_path / "4k")), kv_cache_dtype="fp8"),
    }
    layer = fp8.cache.layers[1]
    assert torch.equal(layer.k_scale, torch.ones_like(layer.k_scale))  # uncalibrated fp8: scale 1.0
    layer.k_scale = layer.k_scale * 2  # a recalibration of one layer's K scale
    others["k_scale x2"] = namespace_digest(fp8.model_path, fp8.dtype, fp8.cache)
    assert len({base, *others.values()}) == 1 + len(others) == 6
    assert all(len(d) == 32 for d in others.values())


def test_namespace_covers_a_4bit_caches_ratios_and_key_basis(tiny_dir):
    """Clipping ratios and the key basis decide a per-token 4-bit cache's bytes as static scales do."""
    from qkv.key_basis import KeyBasis

    int4 = LLM(str(tiny_dir("llama")), **SMALL, kv_cache_dtype="int4_per_token_head").llm_engine

    def now() -> bytes:
        return namespace_digest(int4.model_path, int4.dtype, int4.cache)

    seen = [now()]
    layer = int4.cache.layers[2]
    layer.k_clip = 0.925
    seen.append(now())
    layer.key_basis = KeyBasis(torch.zeros(2, 16), torch.ones(2, 16))
    seen.append(now())
    layer.key_basis = KeyBasis(torch.zeros(2, 16), torch.full((2, 16), 2.0))
    seen.append(now())
    assert len(set(seen)) == 4
    layer.k_clip, layer.key_basis = 1.0, None
    assert now() == seen[0]  # uncalibrated: the digest it always had


def test_cache_salt_keys_are_disjoint_and_miss_the_tier(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), **SMALL, kv_offloading_size=0.001)
    engine, offload = llm.llm_engine, llm.llm_engine.offload
    plain, salted = chain(PROMPT), chain(PROMPT, salt="tenant-b")
    assert len({offload.key(h) for h in plain + salted}) == 6  # every block differs, not just the first
    tokens = llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids
    evict_free_blocks(engine.pool)
    assert [offload.key(h) in offload.tier for h in plain + salted] == [True] * 3 + [False] * 3

    def run(salt):
        rid = engine.add_request(PROMPT, PARAMS, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    return out.outputs[0].token_ids

    assert run("tenant-b") == tokens
    c = offload.counters()
    assert (c["external_prefix_cache_hits"], c["kv_offload_loaded_blocks"]) == (0, 0)  # salted: a miss
    evict_free_blocks(engine.pool)
    assert run(None) == tokens
    c = offload.counters()
    assert (c["external_prefix_cache_queries"], c["external_prefix_cache_hits"]) == (3 * 51, 48)
    assert (c["kv_offload_loaded_blocks"], c["kv_offload_stored_blocks"]) == (3, 6)  # the salted blocks went in too
    engine.pool.check_no_leaks()
