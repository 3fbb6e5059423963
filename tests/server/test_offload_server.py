"""A file-backed tier outlives ``qkv serve``: after SIGTERM, or kill -9, the next server hits what was stored.

Real server subprocesses and the official ``openai`` client, nothing mocked. The tier is write-through,
so a prompt's blocks are in files once they are computed: no eviction is needed before a restart.
"What a recomputation gives" is an offline ``LLM`` in another process, with the same flags and its own
tier directory: its files are the bytes a tier entry must hold, header and all.
"""

import random
import threading

import httpx
import pytest
from support.offload import ENGINE, NUM_PREFIX_BLOCKS, PROMPT, TIER_GIB, chain, long_context_copy
from support.server import OfflineReference, ServerProcess, family_sum

from qkv.offload_files import SUFFIX

# Bit-exact across processes that batch differently: batch-invariant GEMMs, one thread each (support.server).
EXACT = {**ENGINE, "batch_invariant": True}
MAX_TOKENS = 4


def tier_flags(directory) -> list[str]:
    return [
        "--kv-offloading-size",
        str(TIER_GIB),
        "--kv-offloading-backend",
        "native",
        "--kv-offloading-dir",
        str(directory),
    ]


def complete(srv: ServerProcess, prompt: list[int]) -> list[int]:
    client = srv.openai()
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        logprobs=0,
    )
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == MAX_TOKENS
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def recomputed(model: str, prompts: list[list[int]], directory) -> list[list[int]]:
    """Token ids of an offline run of ``prompts`` whose own file tier goes to ``directory``."""
    engine = {**EXACT, "kv_offloading_size": TIER_GIB, "kv_offloading_dir": str(directory)}
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    ref = OfflineReference([{"prompt": p, "params": params} for p in prompts], model=model, engine=engine)
    try:
        return [r["token_ids"] for r in ref.result()]
    finally:
        ref.close()


def entries(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name.endswith(SUFFIX)}


@pytest.fixture(scope="module")
def model(tiny_dir, tmp_path_factory):
    return str(long_context_copy(tiny_dir("llama"), tmp_path_factory.mktemp("offload-server") / "tiny-4k"))


def test_after_sigterm_a_restart_hits_the_tier_without_any_eviction(model, tmp_path):
    tier, ref_dir = tmp_path / "tier", tmp_path / "recomputed"
    ref_tokens = recomputed(model, [PROMPT], ref_dir)
    srv = ServerProcess(model=model, engine=EXACT, extra=tier_flags(tier))
    try:
        assert complete(srv, PROMPT) == ref_tokens[0]
        assert srv.metric("qkv:kv_offload_stored_blocks_total") == NUM_PREFIX_BLOCKS  # write-through, no eviction
        assert srv.metric("qkv:external_prefix_cache_hits_total") == 0
        assert srv.terminate() == 0  # the queued writes are flushed within --shutdown-timeout
    finally:
        srv.stop()
    stored = entries(tier)
    assert len(stored) == NUM_PREFIX_BLOCKS and stored == entries(ref_dir)  # the bytes a recomputation stores

    srv = ServerProcess(model=model, engine=EXACT, extra=tier_flags(tier))
    try:
        assert srv.kv()["offload"]["entries_found_at_start"] == NUM_PREFIX_BLOCKS
        assert complete(srv, PROMPT) == ref_tokens[0]
        assert srv.metric("qkv:external_prefix_cache_queries_total") == len(PROMPT)
        assert srv.metric("qkv:external_prefix_cache_hits_total") == 2048
        assert srv.metric("qkv:kv_offload_loaded_blocks_total") == NUM_PREFIX_BLOCKS
        assert srv.metric("qkv:kv_offload_bad_entries_total") == 0
        assert srv.metric("qkv:kv_offload_stored_blocks_total") == 0  # nothing new: every block came from files
    finally:
        srv.stop()
    assert entries(tier) == stored


KILLS = 20
PER_ROUND = 2  # prompts sent at once before each kill: 2 x 65 blocks fit the 139-block pool together
PROMPT_LEN = 1029  # 64 full blocks, all of them hits when stored (the last token is always computed)


def crash_prompts(rounds: int) -> list[list[list[int]]]:
    """Distinct prompts, ``PER_ROUND`` a round, inside the tiny vocabulary, no block shared."""
    rng = random.Random(0)
    return [[[rng.randrange(3, 380) for _ in range(PROMPT_LEN)] for _ in range(PER_ROUND)] for _ in range(rounds)]


def block_files(model: str, prompts: list[list[int]]) -> list[list[str]]:
    """The tier file names of each prompt's full blocks, in chain order, from an engine's own key."""
    from qkv.engine import EngineConfig, LLMEngine

    key = LLMEngine(EngineConfig(model=model, **EXACT, kv_offloading_size=TIER_GIB)).offload.key
    return [[key(h).hex() + SUFFIX for h in chain(p)[: (len(p) - 1) // 16]] for p in prompts]


def send_all(srv: ServerProcess, prompts: list[list[int]]) -> None:
    """Fire the prompts on threads that ignore the connection dying under them (the kill)."""

    def one(p):
        try:
            with srv.client(timeout=60) as c:
                c.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS})
        except httpx.HTTPError:
            pass

    for p in prompts:
        threading.Thread(target=one, args=(p,), daemon=True).start()


def kill_while_writing(srv: ServerProcess, before: float) -> bool:
    """SIGKILL once a step of this round has queued block writes; True if the last scrape saw them queued."""
    queued = False
    for _ in range(2000):
        try:
            m = srv.metrics()
        except httpx.HTTPError:
            break
        queued = family_sum(m, "qkv:kv_offload_write_queue_bytes") > 0
        if queued or family_sum(m, "qkv:kv_offload_stored_blocks_total") > before:
            break
    srv.proc.kill()
    srv.proc.wait(30)
    return queued


def test_kill_9_while_writing_never_serves_a_bad_entry(model, tmp_path, record):
    tier, ref_dir = tmp_path / "tier", tmp_path / "recomputed"
    rounds = crash_prompts(KILLS + 1)
    flat = [p for r in rounds for p in r]
    ref_tokens = recomputed(model, flat, ref_dir)
    reference = entries(ref_dir)
    names = block_files(model, flat)
    assert {n for f in names for n in f} == set(reference)  # the test derives the server's file names right
    queued_kills = leftover_tmp = 0
    for i in range(KILLS + 1):
        srv = ServerProcess(model=model, engine=EXACT, extra=tier_flags(tier), api_key=None)
        try:
            # after the start's scan: no temporary file is left, and every entry holds a recomputation's bytes
            found = entries(tier)
            assert sorted(p.name for p in tier.iterdir()) == sorted(found)
            assert {n: reference.get(n) for n in found} == found
            if i > 0:  # the last round again: a hit for each leading block that reached a file, the same tokens
                expected_hits = 0
                for j, p in enumerate(rounds[i - 1]):
                    assert complete(srv, p) == ref_tokens[PER_ROUND * (i - 1) + j]
                    files = names[PER_ROUND * (i - 1) + j]
                    expected_hits += 16 * next((k for k, n in enumerate(files) if n not in found), len(files))
                assert srv.metric("qkv:external_prefix_cache_hits_total") == expected_hits
                assert srv.metric("qkv:kv_offload_bad_entries_total") == 0
            if i == KILLS:
                break
            before = srv.metric("qkv:kv_offload_stored_blocks_total")
            send_all(srv, rounds[i])
            queued_kills += kill_while_writing(srv, before)
            leftover_tmp += sum(1 for p in tier.iterdir() if p.name.endswith(".tmp"))
        finally:
            srv.stop()
    record(
        f"{KILLS} kills in a row passed: {queued_kills} with block writes queued, {leftover_tmp} temporary files left"
    )
