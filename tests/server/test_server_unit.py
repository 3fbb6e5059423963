"""Server pieces without a real model or a socket: text deltas, request parsing, the engine thread,
and the app in-process (httpx's ASGI transport) on a tiny random Llama."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from support.server import running_app

from qkv import LLM, SamplingParams
from qkv.server.app import kv_report
from qkv.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from qkv.server.streaming import TextDeltas


def test_text_deltas_hold_back_stop_prefixes_and_partial_characters():
    d = TextDeltas(["STOP"])
    assert d("Hello wor", False) == "Hello "  # last 3 chars could start "STOP"
    assert d("Hello world ST", False) == "world"
    assert d("Hello world ", True) == " "  # engine cut "STOP": the held-back tail was never sent
    d = TextDeltas([])
    assert d("caf\ufffd", False) == "caf"  # incomplete UTF-8 character
    assert d("café", False) == "é"
    assert d("café!", True) == "!"
    parts, d, text = [], TextDeltas(["\n\n"]), "a\nb\n\nc"
    for k in range(1, len(text) + 1):
        parts.append(d(text[:k], k == len(text)))
    assert "".join(parts) == text


def test_parse_request_errors():
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, {"prompt": "x", "max_tokens": "3"})
    assert (e.value.status, e.value.param) == (400, "max_tokens")
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": 3}]})
    assert e.value.param == "messages"
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, "just a string")
    assert e.value.status == 400
    req = parse_request(CompletionRequest, {"prompt": ["one"], "temperature": 0, "top_k": 5, "unknown": 1})
    assert req.prompts() == ["one"]
    sp = req.sampling_params(req.max_tokens)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, 5, 16)
    for bad, param in (
        ({"max_tokens": 0}, "max_tokens"),  # 0 is allowed with echo
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ):
        r = parse_request(CompletionRequest, {"prompt": "x", **bad})
        with pytest.raises(APIError) as e:
            r.sampling_params(r.max_tokens)
        assert e.value.param == param
    for bad, param in (({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"best_of": 129}, "best_of")):
        with pytest.raises(APIError) as e:  # the range is checked by the request model itself
            parse_request(CompletionRequest, {"prompt": "x", **bad})
        assert (e.value.status, e.value.param) == (400, param)
    chat = parse_request(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7,
        },
    )
    assert chat.template_messages() == [{"role": "user", "content": "ab"}]
    assert chat.effective_max_tokens == 7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from support.tiny_models import make_tiny_model

    return str(make_tiny_model("llama", tmp_path_factory.mktemp("srv") / "llama"))


def test_async_engine_abort_frees_blocks(tiny):
    async def main():
        async with running_app(tiny) as (_, eng):
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            seen = 0
            async with contextlib.aclosing(eng.generate("r1", "The quick brown fox", params)) as gen:
                async for _ in gen:
                    seen += 1
                    if seen == 3:
                        break
            for _ in range(100):
                kv = await eng.call(kv_report)
                if kv["num_referenced_blocks"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert kv["num_referenced_blocks"] == 0 and kv["num_free_blocks"] == kv["num_usable_blocks"]
            with pytest.raises(ValueError, match="empty"):
                await eng.add("r2", "", params)
            assert eng.alive
        assert not eng.alive  # lifespan shutdown stopped the engine thread

    asyncio.run(main())


def test_app_in_process_matches_offline(tiny):
    prompt = "Paged attention stores keys"
    ref = (
        LLM(tiny, dtype="float32", num_blocks=64)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .text
    )

    async def main():
        async with running_app(tiny, api_key="k") as (c, _):
            h = {"Authorization": "Bearer k"}
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = await c.post("/v1/completions", json=body, headers=h)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
            r = await c.post("/v1/completions", json={**body, "stream": True}, headers=h)
            import json

            texts = [json.loads(ln[6:])["choices"][0]["text"] for ln in r.text.splitlines() if ln.startswith("data: {")]
            assert "".join(texts) == ref and r.text.rstrip().endswith("data: [DONE]")
            r = await c.post(
                "/v1/chat/completions",
                headers=h,
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
            assert (await c.post("/v1/completions", json=body)).status_code == 401
            assert (await c.get("/health")).status_code == 200
            m = (await c.get("/metrics")).text
            assert 'qkv:generation_tokens_total{model_name="tiny"} 24.0' in m

    asyncio.run(main())


def test_serve_cli_defaults():
    from qkv.cli import build_parser

    args = build_parser().parse_args(["serve", "smollm2-135m", "--kv-cache-dtype", "fp8"])
    assert (args.host, args.port, args.max_request_body, args.kv_cache_dtype) == ("127.0.0.1", 8000, "1MiB", "fp8")
    assert args.func.__module__ == "qkv.server.cli"
