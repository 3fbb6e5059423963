"""A file-backed tier outlives ``qkv serve``: after a restart with the same --kv-offloading-dir, a hit.

A real server subprocess and the official ``openai`` client, nothing mocked. The first server computes
a 2,048-token prefix and evicts it into files by serving two other prompts of the same length (its
pool holds one such sequence); the second server, started on the same directory, must load all 128
blocks from there and answer with the same completion.
"""

from support.offload import ENGINE, NUM_PREFIX_BLOCKS, PROMPT, TIER_GIB, long_context_copy
from support.server import ServerProcess

OTHERS = [[t + 1 for t in PROMPT], [t + 2 for t in PROMPT]]  # same length, no block in common


def complete(srv: ServerProcess, prompt: list[int]) -> str:
    client = srv.openai()
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 4
    return out.choices[0].text


def test_restarted_server_hits_the_file_tier(tiny_dir, tmp_path):
    model = str(long_context_copy(tiny_dir("llama"), tmp_path / "tiny-4k"))
    tier = tmp_path / "tier"
    extra = [
        "--kv-offloading-size",
        str(TIER_GIB),
        "--kv-offloading-backend",
        "native",
        "--kv-offloading-dir",
        str(tier),
    ]
    srv = ServerProcess(model=model, engine=ENGINE, extra=extra)
    try:
        cold = complete(srv, PROMPT)
        for other in OTHERS:
            complete(srv, other)
        stored = srv.metric("qkv:kv_offload_stored_blocks_total")
        # the first prompt's 128 prefix blocks, then the 118 of the second's that the third evicted
        # (the pool has 139 usable blocks: 11 free beside a cached 128-block prefix)
        assert stored == NUM_PREFIX_BLOCKS + 118 == 246 and srv.metric("qkv:external_prefix_cache_hits_total") == 0
        assert srv.terminate() == 0
    finally:
        srv.stop()
    assert len(list(tier.glob("*.kvblock"))) == stored

    srv = ServerProcess(model=model, engine=ENGINE, extra=extra)
    try:
        assert srv.kv()["offload"]["entries"] == stored  # the index was rebuilt from the directory
        assert complete(srv, PROMPT) == cold
        assert srv.metric("qkv:external_prefix_cache_queries_total") == len(PROMPT)
        assert srv.metric("qkv:external_prefix_cache_hits_total") == 2048
        assert srv.metric("qkv:kv_offload_loaded_blocks_total") == NUM_PREFIX_BLOCKS
        assert srv.metric("qkv:kv_offload_bad_entries_total") == 0
    finally:
        srv.stop()
