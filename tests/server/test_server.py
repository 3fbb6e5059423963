"""``qkv serve`` as a subprocess on SmolLM2-135M (fp8 KV), driven by the ``openai`` client and httpx.

Greedy (and seeded) outputs must equal ``LLM.generate`` with the same engine flags; every bad request
gets an OpenAI-style error with the right status and the server keeps serving.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.server import API_KEY, MODEL, OfflineReference, ServerProcess

pytestmark = pytest.mark.slow

COMPLETIONS = [
    ("The capital of France is", {"temperature": 0, "max_tokens": 24}),
    ("def fibonacci(n):", {"temperature": 0, "max_tokens": 24}),
    ("Once upon a time, in a small village at the edge of a great forest,", {"temperature": 0, "max_tokens": 24}),
    ("1, 2, 3, 4, 5,", {"temperature": 0, "max_tokens": 24, "stop": [" 9", "never"]}),
    ("My favourite colour is", {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_tokens": 16}),
]
CHATS = [
    ([{"role": "user", "content": "What is the capital of France?"}], {"temperature": 0, "max_tokens": 24}),
    (
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
        {"temperature": 0, "max_tokens": 24},
    ),
]


@pytest.fixture(scope="module")
def reference():
    ref = OfflineReference(
        [{"prompt": p, "params": sp} for p, sp in COMPLETIONS] + [{"messages": m, "params": sp} for m, sp in CHATS]
    )
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def server(reference):  # the reference starts first and runs while the server loads
    srv = ServerProcess()
    yield srv
    srv.stop()


def _ref(reference, i):
    return reference.result()[i]


def _openai_kwargs(sp: dict) -> tuple[dict, dict]:
    """Split sampling params into the openai client's own arguments and vLLM extras (extra_body)."""
    own = {k: v for k, v in sp.items() if k in ("temperature", "top_p", "seed", "max_tokens", "stop")}
    extra = {k: v for k, v in sp.items() if k not in own}
    return own, extra


# -- happy paths -----------------------------------------------------------------------------------------
def test_models_health_version(server):
    c = server.client()
    assert c.get("/health").status_code == 200
    assert c.get("/version").json()["version"]
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("i", range(len(COMPLETIONS)))
def test_completion_matches_offline(server, reference, i):
    prompt, sp = COMPLETIONS[i]
    own, extra = _openai_kwargs(sp)
    r = server.openai().completions.create(model=MODEL, prompt=prompt, extra_body=extra or None, **own)
    ref = _ref(reference, i)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.prompt_tokens == ref["num_prompt_tokens"]
    assert r.usage.completion_tokens == len(ref["token_ids"])
    if i == 0:
        assert "Paris" in r.choices[0].text
    if "stop" in sp:
        assert r.choices[0].finish_reason == "stop" and " 9" not in r.choices[0].text


@pytest.mark.parametrize("j", range(len(CHATS)))
def test_chat_matches_offline(server, reference, j):
    messages, sp = CHATS[j]
    r = server.openai().chat.completions.create(model=MODEL, messages=messages, **sp)
    ref = _ref(reference, len(COMPLETIONS) + j)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.prompt_tokens == ref["num_prompt_tokens"]  # same templated prompt


@pytest.mark.parametrize("i", [0, 3])
def test_completion_streaming(server, reference, i):
    prompt, sp = COMPLETIONS[i]
    own, extra = _openai_kwargs(sp)
    stream = server.openai().completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, extra_body=extra or None, **own
    )
    chunks = list(stream)
    ref = _ref(reference, i)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref["text"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # really streamed
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref["finish_reason"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    assert len({c.id for c in chunks}) == 1


def test_chat_streaming(server, reference):
    messages, sp = CHATS[1]
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **sp
    )
    chunks = list(stream)
    ref = _ref(reference, len(COMPLETIONS) + 1)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        ref["finish_reason"]
    ]
    assert chunks[-1].usage.prompt_tokens == ref["num_prompt_tokens"]


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(ln[6:]) for ln in lines[:-1])  # no include_usage: no usage key


# -- errors ----------------------------------------------------------------------------------------------
LONG_PROMPT = "hello " * 1100  # > max_model_len=1024 tokens

ERROR_CASES = [
    # (id, path, raw body or JSON, status, param, code)
    ("malformed-json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
    ("not-an-object", "/v1/chat/completions", [1, 2], 400, None, None),
    (
        "max-tokens-type",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": "ten"},
        400,
        "max_tokens",
        None,
    ),
    (
        "temperature-type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    ("messages-type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("stream-type", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", None),
    (
        "prompt-too-long",
        "/v1/completions",
        {"model": MODEL, "prompt": LONG_PROMPT},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("max-tokens-zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    (
        "max-tokens-negative-chat",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
        400,
        "max_tokens",
        None,
    ),
    ("n-0", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", None),
    (
        "best-of-below-n-chat",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3, "best_of": 2},
        400,
        "best_of",
        None,
    ),
    ("logprobs-21", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("top-p-range", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("empty-prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("bad-token-id", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", None),
    ("second-prompt-empty", "/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt", None),
    ("empty-messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("unknown-model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model", "model_not_found"),
    (
        "unknown-model-chat",
        "/v1/chat/completions",
        {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model",
        "model_not_found",
    ),
    ("body-too-large", "/v1/completions", {"model": MODEL, "prompt": "x" * (1 << 20)}, 413, None, "request_too_large"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_responses(server, case):
    _, path, body, status, param, code = case
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param
        if code is not None:
            assert err["code"] == code
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_openai_client_raises_typed_errors(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # a streaming request is rejected before the stream starts
        client.completions.create(model=MODEL, prompt="hi", n=2, best_of=3, stream=True)


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models", headers=headers, timeout=60).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60).status_code == 200


def test_unknown_route_is_json_404(server):
    r = server.client().get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_metrics_exposed(server):
    text = httpx.get(server.url + "/metrics").text
    for family in (
        "qkv:num_requests_running",
        "qkv:num_requests_waiting",
        "qkv:kv_cache_usage_perc",
        "qkv:prefix_cache_queries_total",
        "qkv:prefix_cache_hits_total",
        "qkv:num_preemptions_total",
        "qkv:prompt_tokens_total",
        "qkv:generation_tokens_total",
        "qkv:time_to_first_token_seconds_bucket",
        "qkv:inter_token_latency_seconds_bucket",
        "qkv:e2e_request_latency_seconds_bucket",
        "qkv:request_success_total",
    ):
        assert family in text, family
    assert server.metric("qkv:generation_tokens_total") > 0
    assert server.metric("qkv:time_to_first_token_seconds_count") > 0
    kv = server.wait_idle()
    assert kv["num_free_blocks"] == kv["num_usable_blocks"]
