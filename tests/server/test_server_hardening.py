"""Issue 15's hostile requests, one by one: every one is a 4xx naming the field, none a 5xx; failures inside
the engine are contained; streams cut at shutdown end with an SSE error event and ``[DONE]``.

In-process (httpx's ASGI transport re-raises anything the app lets escape) on a tiny random Llama, plus
one real ``qkv serve`` subprocess for the shutdown.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from support.server import ServerProcess, parse_metrics, running_app

ENGINE = {"dtype": "float32", "num_blocks": 64, "max_model_len": 256}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
HI = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, body (bytes or JSON), status, param, code, message (regex))
    (
        "nested-1000-deep",
        "/v1/completions",
        b"[" * 1000 + b"]" * 1000,
        400,
        None,
        "invalid_json",
        "the request body is nested more than 32 levels deep",
    ),
    (
        "nested-under-a-field",
        "/v1/completions",
        b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}",
        400,
        "prompt",
        "invalid_json",
        "nested more than 32 levels",
    ),
    (
        "surrogate-model",
        "/v1/completions",
        b'{"model": "\\ud800", "prompt": "hi"}',
        400,
        "model",
        None,
        r"'model' holds a lone surrogate \(U\+D800\), which is not valid Unicode text",
    ),
    ("surrogate-prompt", "/v1/completions", b'{"prompt": "hi \\udfff"}', 400, "prompt", None, r"U\+DFFF"),
    (
        "surrogate-chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        400,
        "messages",
        None,
        "lone surrogate",
    ),
    (
        "surrogate-key",
        "/v1/completions",
        b'{"\\ud800": 1, "prompt": "hi"}',
        400,
        None,
        None,
        "the request body holds a lone surrogate",
    ),
    (
        "int-too-long",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        400,
        None,
        "invalid_json",
        "not valid JSON: Exceeds the limit",
    ),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json", "not valid JSON"),
    (
        "temperature-Infinity",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": Infinity}',
        400,
        "temperature",
        None,
        "Input should be a finite number",
    ),
    (
        "temperature-1e999",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": 1e999}',
        400,
        "temperature",
        None,
        "finite number",
    ),
    (
        "temperature-NaN",
        "/v1/chat/completions",
        b'{"messages": [], "temperature": NaN}',
        400,
        "temperature",
        None,
        "finite number",
    ),
    (
        "temperature-2.5",
        "/v1/completions",
        {"prompt": "hi", "temperature": 2.5},
        400,
        "temperature",
        None,
        "less than or equal to 2",
    ),
    (
        "max-tokens-1e9",
        "/v1/completions",
        {"prompt": [5, 6, 7], "max_tokens": 10**9},
        400,
        "max_tokens",
        "context_length_exceeded",
        "max_tokens=1000000000 does not fit: the prompt has 3 tokens and max_model_len=256, so max_tokens can "
        "be at most 253",
    ),
    (
        "max-completion-tokens-chat",
        "/v1/chat/completions",
        {"messages": HI, "max_completion_tokens": 10**9},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
        "does not fit",
    ),
    (
        "max-tokens-float-1e9",  # a whole number, so an integer to JSON Schema: refused for its size
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 1e9}',
        400,
        "max_tokens",
        "context_length_exceeded",
        "max_tokens=1000000000 does not fit",
    ),
    (
        "max-tokens-fraction",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2.5}',
        400,
        "max_tokens",
        None,
        "valid integer",
    ),
    (
        "seed-2**70",
        "/v1/completions",
        {"prompt": "hi", "seed": 2**70},
        400,
        "seed",
        None,
        "less than or equal to 9223372036854775807",
    ),
    ("top-k-float", "/v1/completions", {"prompt": "hi", "top_k": 1.5}, 400, "top_k", None, "valid integer"),
    ("top-k-bool", "/v1/completions", {"prompt": "hi", "top_k": True}, 400, "top_k", None, "valid integer"),
    ("stop-int", "/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop", None, ""),
    (
        "stop-empty",
        "/v1/completions",
        {"prompt": "hi", "stop": [""]},
        400,
        "stop",
        None,
        "stop must be a non-empty string",
    ),
    (
        "min-over-max",
        "/v1/completions",
        {"prompt": "hi", "min_tokens": 5, "max_tokens": 2},
        400,
        "min_tokens",
        None,
        r"min_tokens must be <= max_tokens \(2\), got 5",
    ),
    (
        "cache-salt-empty",
        "/v1/completions",
        {"prompt": "hi", "cache_salt": ""},
        400,
        "cache_salt",
        None,
        "at least 1 character",
    ),
    (
        "top-p-tiny-is-served",
        "/v1/completions",
        {"prompt": "hi", "top_p": 4e-207, "max_tokens": 2},
        200,
        None,
        None,
        None,
    ),
    (
        "temperature-tiny-is-served",
        "/v1/completions",
        {"prompt": "hi", "temperature": 1e-300, "max_tokens": 2},
        200,
        None,
        None,
        None,
    ),
]


def run(coro_fn, tiny, **kw):
    async def main():
        async with running_app(tiny, ENGINE, **kw) as (client, engine):
            engine.engine.tokenizer.chat_template = CHAT_TEMPLATE
            return await coro_fn(client, engine)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return str(tiny_dir("llama"))


def test_hostile_requests_get_4xx_naming_the_field(tiny):
    async def main(client, engine):
        for name, path, body, status, param, code, message in CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await client.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (name, r.text)
            if status != 200:
                err = r.json()["error"]
                assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), name
                assert __import__("re").search(message, err["message"]), (name, err["message"])
        # the 404 handler does not parse the client's Host header
        r = await client.get("/nothing", headers={"Host": "["})
        assert r.status_code == 404 and r.json()["error"]["message"] == "GET /nothing: Not Found"
        assert (await client.get("/health")).status_code == 200

    run(main, tiny)


def test_engine_failures_are_contained(tiny, monkeypatch):
    async def main(client, engine):
        real = engine.engine.runner.execute
        state = {"fail": True}

        def execute(sched, block_size):
            if state["fail"]:
                raise RuntimeError("boom")
            return real(sched, block_size)

        monkeypatch.setattr(engine.engine.runner, "execute", execute)
        body = {"prompt": "The quick", "max_tokens": 4}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "the engine failed on this request: the forward pass failed: RuntimeError: boom",
            "type": "server_error",
            "param": None,
            "code": 500,
        }
        r = await client.post("/v1/completions", json={**body, "stream": True})
        lines = [ln for ln in r.text.split("\n") if ln]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["type"] == "server_error"
        state["fail"] = False
        assert (await client.post("/v1/completions", json=body)).status_code == 200  # the engine serves on
        await engine.call(lambda e: e.pool.check_no_leaks())

        from qkv.server import serving  # an unexpected exception in a route: one 500, nothing escapes

        async def broken(self, request, data):
            raise KeyError("bug")

        monkeypatch.setattr(serving.OpenAIServing, "completions", broken)
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: KeyError"

    run(main, tiny)


def test_streams_cut_at_shutdown_end_with_an_error_event_and_done(tiny):
    # One running sequence at a time: the streams behind the first wait, so they are still running when
    # the 1 s --shutdown-timeout ends (each needs 500 decode steps after the one before it).
    srv = ServerProcess(
        model=tiny,
        engine={"dtype": "float32", "max_num_seqs": 1, "num_blocks": 200},
        extra=["--shutdown-timeout", "1"],
        api_key=None,
        startup_timeout=120,
    )
    body = {"prompt": "The quick brown fox", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    results: dict[int, object] = {}
    first_chunk = threading.Event()

    def stream(i: int) -> None:
        try:
            with (
                httpx.Client(base_url=srv.url, timeout=120) as c,
                c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
            ):
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()
                results[i] = lines
        except Exception as e:  # noqa: BLE001 - e.g. httpx.RemoteProtocolError: incomplete chunked read
            results[i] = e

    def plain() -> None:
        results["plain"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

    def waiting() -> float:
        m = parse_metrics(httpx.get(srv.url + "/metrics", timeout=30).text)
        return sum(v for k, v in m.items() if k.startswith("qkv:num_requests_waiting"))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [threading.Thread(target=plain)]
    try:
        # In a fixed order: stream 0 runs, then streams 1 and 2 and the plain request queue behind it, each
        # seen waiting before the next is sent, so the last two are the ones the shutdown must cut.
        threads[0].start()
        assert first_chunk.wait(60)
        for n, t in enumerate(threads[1:], start=1):
            t.start()
            deadline = time.monotonic() + 60
            while waiting() < n and time.monotonic() < deadline:
                time.sleep(0.01)
        assert srv.terminate(120) == 0
        for t in threads:
            t.join(60)
    finally:
        srv.stop()
    log = srv.log_tail(100_000)
    for i in range(3):
        lines = results[i]
        assert isinstance(lines, list), lines  # no incomplete chunked read
        assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
        last = json.loads(lines[-2][6:])
        assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert json.loads(results[2][-2][6:]) == {
        "error": {"message": "the server is shutting down", "type": "service_unavailable", "param": None, "code": 503}
    }
    assert results["plain"].status_code == 503
    assert results["plain"].json()["error"]["message"] == "the server is shutting down"
    assert "--shutdown-timeout of 1.0 s reached" in log
    assert "Traceback" not in log and "CancelledError" not in log
