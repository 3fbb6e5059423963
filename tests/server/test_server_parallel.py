"""n / best_of, batched prompts and logprobs through both OpenAI endpoints, streamed and not, equal to offline.

In-process (httpx's ASGI transport) on a tiny random Llama with --batch-invariant, so the server's batches
and the offline reference's give the same logits.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support.server import parse_metrics, running_app

from qkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = {"dtype": "float32", "num_blocks": 64, "max_model_len": 256, "batch_invariant": True}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys",
]  # both end mid-block: each n=2 request copies one block
SAMPLED = {"n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
ECHO_PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return str(tiny_dir("llama"))


@pytest.fixture(scope="module")
def offline(tiny):
    llm = LLM(tiny, **ENGINE)
    params = SamplingParams(**SAMPLED)
    texts = [[c.text for c in llm.generate([p], params)[0].outputs] for p in PROMPTS]
    echo = llm.generate([ECHO_PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))[0]
    best = llm.generate([PROMPTS[0]], SamplingParams(**{**SAMPLED, "n": 1, "best_of": 3}))[0].outputs[0].text
    return {
        "texts": [t for pair in texts for t in pair],
        "prompt_logprobs": echo.prompt_logprobs,
        "best_of": best,
        "prompt_text": llm.llm_engine.tokenizer.decode(ECHO_PROMPT),
    }


def _serve(tiny, coro_fn):
    async def main():
        async with running_app(tiny, ENGINE) as (client, engine):
            engine.engine.tokenizer.chat_template = CHAT_TEMPLATE
            return await coro_fn(client, engine)

    return asyncio.run(main())


def _stream_texts(body: str) -> tuple[dict[int, str], dict[int, str]]:
    texts, finish = {}, {}
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    return texts, finish


def test_batch_of_prompts_with_n_equals_offline(tiny, offline):
    """Choice index = prompt * n + sample; sample i of a prompt is seeded seed + i, as offline."""

    async def main(client, engine):
        r = await client.post("/v1/completions", json={"prompt": PROMPTS, **SAMPLED})
        s = await client.post("/v1/completions", json={"prompt": PROMPTS, **SAMPLED, "stream": True})
        b = await client.post("/v1/completions", json={"prompt": PROMPTS[0], **SAMPLED, "n": 1, "best_of": 3})
        m = parse_metrics((await client.get("/metrics")).text)
        kv = (await client.get("/debug/kv")).json()
        return r, s, b, m, kv

    r, s, b, metrics, kv = _serve(tiny, main)
    assert [c["text"] for c in b.json()["choices"]] == [offline["best_of"]]
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == offline["texts"]
    assert body["usage"]["completion_tokens"] == 4 * 8
    texts, finish = _stream_texts(s.text)
    assert [texts[i] for i in range(4)] == offline["texts"]
    assert finish == {i: "length" for i in range(4)}
    # 2 requests x 2 prompts x 1 copy, and best_of=3: 2 copies
    assert metrics['qkv:kv_cow_copies_total{model_name="tiny"}'] == 6.0
    assert kv["num_shared_blocks"] == 0 and kv["num_cow_copies"] == 6  # all finished: nothing held


def test_echo_with_logprobs_gives_prompt_logprobs(tiny, offline):
    """lm-eval's local-completions request: echo, logprobs, max_tokens 0, a list of token-id prompts."""

    async def main(client, engine):
        return await client.post(
            "/v1/completions",
            json={
                "prompt": [ECHO_PROMPT, ECHO_PROMPT[:9]],
                "echo": True,
                "logprobs": 1,
                "max_tokens": 0,
                "temperature": 0,
            },
        )

    r = _serve(tiny, main)
    assert r.status_code == 200, r.text
    choice, short = r.json()["choices"]
    assert short["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"][:9]
    lp = choice["logprobs"]
    assert choice["text"] == offline["prompt_text"]
    assert len(lp["tokens"]) == len(ECHO_PROMPT) and lp["token_logprobs"][0] is None
    ref = offline["prompt_logprobs"]
    for p in range(1, len(ECHO_PROMPT)):
        assert lp["token_logprobs"][p] == pytest.approx(ref[p][ECHO_PROMPT[p]].logprob, abs=1e-6)
        assert len(lp["top_logprobs"][p]) in (1, 2)  # the prompt's token and the top 1 (the same one, or not)
    assert "".join(lp["tokens"]) == choice["text"]
    assert r.json()["usage"] == {
        "prompt_tokens": 29,
        "completion_tokens": 0,
        "total_tokens": 29,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_logprobs_and_n(tiny):
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 6,
        "ignore_eos": True,
    }

    async def main(client, engine):
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "n": 2,
                "logprobs": True,
                "top_logprobs": 2,
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        sampled = await client.post("/v1/chat/completions", json=chat)
        streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        return r, sampled, streamed

    r, sampled, streamed = _serve(tiny, main)
    contents = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                contents[c["index"]] = contents.get(c["index"], "") + (c["delta"].get("content") or "")
    assert [contents[0], contents[1]] == [c["message"]["content"] for c in sampled.json()["choices"]]
    assert contents[0] != contents[1]  # seeds 5 and 6
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["message"] == choices[1]["message"]  # greedy: both samples alike
    content = choices[0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]  # greedy takes the best token
        assert entry["token"] == entry["top_logprobs"][0]["token"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, "best_of"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": ["hi", []]}, "prompt"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"prompt": "hi", "n": 129}, "n"),
    ],
)
def test_bad_parallel_and_logprob_fields_are_400(tiny, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"

    async def main(client, engine):
        return await client.post(path, json=body)

    r = _serve(tiny, main)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
