"""Prefix-cache metrics count each request once, however often memory pressure delays its admission.

12 requests of 40 tokens share a 32-token prefix (two blocks of 16) on a pool of 8 usable blocks, so
requests wait, are looked up again and again, and running ones get preempted. Every request is admitted
once (first admission) with a lookup of its 40 prompt tokens; the first computes the prefix, each of the
11 others finds its 32 tokens cached (the scheduler's budget of 40 tokens admits one prefill per step, so
the prefix is written before the second request is looked up). So the counters must read exactly
12 x 40 = 480 queries and 11 x 32 = 352 hits; before the fix they counted every lookup.
"""

import asyncio

from support.server import parse_metrics, running_app

from qkv import LLM, SamplingParams

PREFIX = list(range(10, 42))  # 32 tokens: 2 full blocks
PROMPTS = [PREFIX + [50 + i] * 8 for i in range(12)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(dtype="float32", num_blocks=9, max_num_batched_tokens=40, max_model_len=64)
QUERIES, HITS = 12 * 40, 11 * 32


def test_engine_counts_once_per_admitted_request(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), **ENGINE)
    engine = llm.llm_engine
    outs = llm.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    stats = engine.stats
    assert stats.num_alloc_failures > 0 and stats.num_preemptions > 0  # there was pressure
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (QUERIES, HITS)
    assert stats.prefix_cache_hit_rate == HITS / QUERIES
    engine.pool.check_no_leaks()


def test_server_metrics_under_pressure(tiny_dir):
    async def main():
        async with running_app(str(tiny_dir("llama")), ENGINE) as (client, _):
            bodies = [
                {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True} for p in PROMPTS
            ]
            rs = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            assert [r.status_code for r in rs] == [200] * 12
            assert all(r.json()["usage"]["completion_tokens"] == 24 for r in rs)
            return parse_metrics((await client.get("/metrics")).text)

    m = asyncio.run(main())
    assert m['qkv:prefix_cache_queries_total{model_name="tiny"}'] == QUERIES
    assert m['qkv:prefix_cache_hits_total{model_name="tiny"}'] == HITS
    assert m['qkv:num_preemptions_total{model_name="tiny"}'] > 0
