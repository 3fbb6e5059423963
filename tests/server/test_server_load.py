"""Load, disconnects and SIGTERM against a real ``qkv serve smollm2-135m --kv-cache-dtype fp8``.

* 64 concurrent streaming chat requests of mixed lengths, half sharing a long system prompt, arriving
  20 ms apart: all finish with the offline engine's finish reasons and token counts, prefix-cache hits
  show in /metrics, and afterwards every block is free (or free and cached). Under --batch-invariant
  (the engine flags both sides use) the texts equal ``LLM.generate``'s exactly, whatever batches,
  prefill chunks and prefix hits the arrival timing produced. p50/p99 TTFT are printed, not asserted.
* 10 streaming clients disconnect mid-generation: their requests are aborted and their blocks freed,
  while other requests finish with the right outputs.
* SIGTERM while a request streams: it completes, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import httpx
import pytest
from support.server import ENGINE, MODEL, OfflineReference, ServerProcess, percentile

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are Quill, the assistant of a small public library. Answer the visitor's question in a friendly "
    "and concise way. Recommend at most one book. If you do not know something, say so plainly and suggest "
    "asking the librarian at the front desk. Never invent opening hours, prices or phone numbers. Keep "
    "answers under three sentences and avoid lists unless the visitor asks for one."
)
TOPICS = [
    "the ocean",
    "volcanoes",
    "medieval castles",
    "honey bees",
    "the moon",
    "jazz",
    "chess openings",
    "rainforests",
    "ancient Rome",
    "glaciers",
    "owls",
    "bread baking",
    "comets",
    "the Silk Road",
    "coral reefs",
    "origami",
]
MAX_TOKENS = (8, 12, 16, 24)
N_LOAD = 64


@functools.cache
def load_requests() -> list[dict]:
    reqs = []
    for i in range(N_LOAD):
        topic = TOPICS[i % len(TOPICS)]
        detail = " ".join(["Please explain it simply, with one concrete example."] * (i % 5))
        system = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
        user = f"Tell me something interesting about {topic}. {detail}".strip()
        reqs.append(
            {
                "messages": system + [{"role": "user", "content": user}],
                "params": {"temperature": 0, "max_tokens": MAX_TOKENS[i % 4]},
            }
        )
    return reqs


SURVIVORS = [
    {"prompt": f"Question {k}: what is {k} plus {k}? Answer:", "params": {"temperature": 0, "max_tokens": 8}}
    for k in range(4)
]


# --batch-invariant (in ENGINE) makes each request's tokens independent of the batch it lands in, of how
# its prefill is chunked and of prefix-cache hits, which depend on arrival timing; outputs are therefore
# compared with the offline engine exactly. A small token budget makes the server chunk prefills.
ENGINE_LOAD = {**ENGINE, "max_num_batched_tokens": 512}


@pytest.fixture(scope="module")
def reference():
    ref = OfflineReference(load_requests() + SURVIVORS, engine=ENGINE_LOAD)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def server(reference):
    srv = ServerProcess(engine=ENGINE_LOAD)
    yield srv
    srv.stop()


async def _stream_chat(client: httpx.AsyncClient, req: dict, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    body = {
        "model": MODEL,
        "messages": req["messages"],
        "stream": True,
        "stream_options": {"include_usage": True},
        **req["params"],
    }
    t0 = time.perf_counter()
    ttft, text, finish, usage = None, [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk["choices"]:
                piece = ch["delta"].get("content")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece or "")
                finish = ch["finish_reason"] or finish
    return {
        "text": "".join(text),
        "finish_reason": finish,
        "ttft": ttft,
        "usage": usage,
        "e2e": time.perf_counter() - t0,
    }


def test_load_64_concurrent_streams(server, reference):
    hits_before = server.metric("qkv:prefix_cache_hits_total")

    async def run():
        limits = httpx.Limits(max_connections=N_LOAD + 8, max_keepalive_connections=N_LOAD + 8)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=900, limits=limits) as client:
            # Arrivals 20 ms apart: the first request is prefilled alone, so the others can hit its prefix.
            return await asyncio.gather(*(_stream_chat(client, r, 0.02 * i) for i, r in enumerate(load_requests())))

    t0 = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - t0
    ref = reference.result()[:N_LOAD]
    mismatches = [
        i
        for i, (got, want) in enumerate(zip(results, ref))
        if (got["text"], got["finish_reason"]) != (want["text"], want["finish_reason"])
    ]
    assert not mismatches, [(i, results[i]["text"], ref[i]["text"]) for i in mismatches[:3]]
    for got, want in zip(results, ref):
        assert got["usage"]["completion_tokens"] == len(want["token_ids"])
        assert got["usage"]["prompt_tokens"] == want["num_prompt_tokens"]
    assert {r["finish_reason"] for r in results} <= {"stop", "length"}
    assert server.metric("qkv:prefix_cache_hits_total") > hits_before  # the shared system prompt hit
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results) > 0
    kv = server.wait_idle()
    assert kv["num_free_blocks"] == kv["num_usable_blocks"] and kv["num_referenced_blocks"] == 0
    assert kv["num_cached_blocks"] > 0  # free but still cached
    assert server.metric("qkv:num_requests_running") == 0
    assert server.metric("qkv:kv_cache_usage_perc") == 0
    assert "Avg generation throughput" in server.log_tail(400)  # the periodic vLLM-style stats line

    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    e2e = [r["e2e"] for r in results]
    gen = sum(r["usage"]["completion_tokens"] for r in results)
    line = (
        f"\n[qkv serve load] {N_LOAD} streams, fp8 KV, SmolLM2-135M, CPU: wall {wall:.1f}s, "
        f"{gen} tokens ({gen / wall:.1f} tok/s); TTFT p50 {percentile(ttfts, 50):.2f}s "
        f"p99 {percentile(ttfts, 99):.2f}s; e2e p50 {percentile(e2e, 50):.2f}s p99 {percentile(e2e, 99):.2f}s"
    )
    print(line)


def test_disconnects_free_blocks(server, reference):
    aborted_before = server.metric("qkv:request_success_total", finished_reason="abort")
    gen_before = server.metric("qkv:generation_tokens_total")
    long_body = {
        "model": MODEL,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def quitter(client: httpx.AsyncClient, k: int) -> int:
        pieces = 0
        async with client.stream("POST", "/v1/completions", json={**long_body, "seed": k}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    pieces += 1
                    if pieces == 2:
                        break  # leaving the block closes the connection mid-generation
        return pieces

    async def survivor(client: httpx.AsyncClient, req: dict) -> dict:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": req["prompt"], **req["params"]})
        assert r.status_code == 200, r.text
        return r.json()

    async def run():
        # Separate clients: a closed streaming connection must not be reused by the survivors.
        async with (
            httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=600) as quitters,
            httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=600) as others,
        ):
            q = [asyncio.create_task(quitter(quitters, k)) for k in range(10)]
            await asyncio.sleep(0.5)
            s = [asyncio.create_task(survivor(others, r)) for r in SURVIVORS]
            return await asyncio.gather(*q), await asyncio.gather(*s)

    pieces, done = asyncio.run(run())
    assert pieces == [2] * 10
    ref = reference.result()[N_LOAD:]
    assert [d["choices"][0]["text"] for d in done] == [r["text"] for r in ref]
    kv = server.wait_idle(timeout=120)
    assert kv["num_free_blocks"] == kv["num_usable_blocks"] and kv["num_referenced_blocks"] == 0
    assert server.metric("qkv:request_success_total", finished_reason="abort") - aborted_before == 10
    # The ten would have produced 4000 tokens had they run on.
    assert server.metric("qkv:generation_tokens_total") - gen_before < 10 * 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_drains_in_flight_request(server):
    """Last in this module: it stops the server."""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, finish, done, usage = [], None, False, None
    with (
        httpx.Client(base_url=server.url, headers=server.headers, timeout=300) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            usage = chunk["usage"] or usage
            if not chunk["choices"]:
                continue
            ch = chunk["choices"][0]
            pieces.append(ch["text"])
            finish = ch["finish_reason"] or finish
            if len(pieces) == 2:
                server.proc.send_signal(15)  # SIGTERM mid-stream
    assert done and finish == "length" and usage["completion_tokens"] == 48
    assert server.proc.wait(120) == 0, server.log_tail()
    log = server.log_tail()
    assert "Shutting down" in log and "server stopped" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
