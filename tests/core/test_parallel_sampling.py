"""Parallel sampling (n, best_of): exact seeds, prompt blocks shared by ref count, copy-on-write per cache dtype."""

import pytest
import torch

from qkv import LLM, SamplingParams
from qkv.server.app import kv_report

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [(7 * i) % 380 + 3 for i in range(37)]  # 37 tokens: 2 full blocks of 16 and a tail of 5


def sampled(seed: int, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=12, ignore_eos=True, **kw)


def make_llm(tiny_dir, kv: str = "auto", **kw) -> LLM:
    # batch_invariant: the 4 samples decode in one batch, the separate requests alone; the logits must not differ.
    return LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=64, kv_cache_dtype=kv, batch_invariant=True, **kw)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "int8_per_token_head"])
def test_n4_equals_four_requests_with_derived_seeds(tiny_dir, kv):
    """The rule (SamplingParams, parallel_sampling.py): sample i is seeded seed + i.

    The prompt ends mid-block, so every sample's first write goes to the shared
    tail block: without copy-on-write the samples would overwrite each other's
    tokens there and diverge from the separate requests.
    """
    llm = make_llm(tiny_dir, kv)
    together = llm.generate([PROMPT], sampled(1000, n=4))[0]
    alone = [llm.generate([PROMPT], sampled(1000 + i))[0].outputs[0].token_ids for i in range(4)]
    assert [c.index for c in together.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in together.outputs] == alone
    assert len({tuple(t) for t in alone}) == 4  # the samples really differ, so sharing was put to the test
    llm.llm_engine.pool.check_no_leaks()


def _decode_until_forked(engine, params: SamplingParams) -> list:
    engine.add_request(PROMPT, params, request_id="r")
    while len(engine.requests["r"].seqs) < params.num_samples or any(
        len(s.output_token_ids) < 2 for s in engine.requests["r"].seqs
    ):
        engine.step()
    return engine.requests["r"].seqs


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "int8_per_token_head"])
def test_blocks_shared_and_tail_copied_bit_exactly(tiny_dir, kv):
    """P=2 full prompt blocks are held once; each of the 4 samples holds its own tail: 2 + 4 x 1 blocks."""
    engine = make_llm(tiny_dir, kv, enable_prefix_caching=False).llm_engine
    seqs = _decode_until_forked(engine, sampled(5, n=4))
    tables = [[b.block_id for b in s.blocks] for s in seqs]
    # The prompt got blocks 1-3. Samples 0-2 copied the shared tail (3) on their first write; sample 3,
    # the last holder, writes into 3 itself.
    assert tables == [[1, 2, 4], [1, 2, 5], [1, 2, 6], [1, 2, 3]]
    held = {b for t in tables for b in t}
    assert len(held) == 2 + 4 * 1
    assert engine.pool.num_shared_blocks() == 2
    assert [engine.pool.blocks[b].ref_cnt for b in (1, 2, 3, 4, 5, 6)] == [4, 4, 1, 1, 1, 1]
    assert engine.kv_manager.num_copies == 3
    report = kv_report(engine)  # what /debug/kv shows
    assert (report["num_shared_blocks"], report["num_cow_copies"], report["num_referenced_blocks"]) == (2, 3, 6)
    # The 5 prompt tokens of the tail are the same bytes (and per-token-head scales) in every copy.
    for layer in engine.cache.layers:
        raw = layer.kv.view(torch.uint8)
        for dst in (4, 5, 6):
            assert torch.equal(raw[dst, :, :5], raw[3, :, :5])
            if layer.scale_cache is not None:
                assert torch.equal(layer.scale_cache[dst, :, :5], layer.scale_cache[3, :, :5])
        assert (layer.scale_cache is not None) == (kv == "int8_per_token_head")
    assert len(engine.cache.layers) == 3


def test_prompt_of_full_blocks_shares_them_all(tiny_dir):
    """A prompt of exactly P=2 full blocks: nothing to copy, each sample opens its own third block."""
    engine = make_llm(tiny_dir, enable_prefix_caching=False).llm_engine
    engine.add_request(PROMPT[:32], sampled(5, n=4), request_id="r")
    while any(len(s.output_token_ids) < 2 for s in engine.requests["r"].seqs) or len(engine.requests["r"].seqs) < 4:
        engine.step()
    tables = [[b.block_id for b in s.blocks] for s in engine.requests["r"].seqs]
    assert tables == [[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 6]]
    assert engine.kv_manager.num_copies == 0


def test_preempting_one_sample_keeps_siblings_blocks(tiny_dir):
    """Preempt sample 3 mid-decode: only its references go; the others keep the prompt and finish unchanged."""
    llm = make_llm(tiny_dir, enable_prefix_caching=False)
    expected = [c.token_ids for c in llm.generate([PROMPT], sampled(9, n=4))[0].outputs]
    engine = llm.llm_engine
    seqs = _decode_until_forked(engine, sampled(9, n=4))
    victim, before = seqs[3], [[b.block_id for b in s.blocks] for s in seqs[:3]]
    shared = before[0][:2]
    assert [t[:2] for t in before] == [shared] * 3 and victim.blocks[:2] == seqs[0].blocks[:2]
    engine.scheduler._preempt(victim)
    assert victim.blocks == []
    assert [engine.pool.blocks[b].ref_cnt for b in shared] == [3, 3]  # siblings still hold the prompt
    assert [[b.block_id for b in s.blocks] for s in seqs[:3]] == before
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert [c.token_ids for c in outs["r"].outputs] == expected
    assert victim.metrics.num_preemptions == 1
    engine.pool.check_no_leaks()


def test_best_of_returns_the_n_best_by_cumulative_logprob(tiny_dir):
    llm = make_llm(tiny_dir)
    out = llm.generate([PROMPT], sampled(3, n=2, best_of=4))[0]
    alone = [llm.generate([PROMPT], sampled(3 + i, logprobs=0))[0].outputs[0] for i in range(4)]
    best = sorted(alone, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_bad_n_and_best_of_name_the_field():
    for kw, field in (({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
