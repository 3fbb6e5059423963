"""Hypothesis strategies for hostile OpenAI request bodies (raw bytes, random JSON, and near-valid requests).

Near-valid bodies matter most: a random JSON value is refused at the first check, while a body with the
right shape and one wrong, extreme or oddly typed field reaches validation, tokenization and the engine.
Values come from the edges: huge and negative integers, booleans where numbers belong, NaN, Infinity and
1e999, lone surrogates, empty strings and lists, deep nesting.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

SURROGATE = "\ud800"
MODELS = st.sampled_from([None, "tiny", "gpt-4", "", SURROGATE, "tiny" * 100])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, 1, -1, 2, 16, 2**31, 2**63, 2**64, 2**70, -(2**63) - 1, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 2.5, 1e-300]),
    st.text(max_size=12),
    st.sampled_from(["", SURROGATE, "a" + SURROGATE, "\udfff", "\x00", "NaN"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)

FIELD_VALUES = {
    "max_tokens": st.one_of(st.integers(-2, 80), st.sampled_from([10**9, 2**70]), scalars),
    "max_completion_tokens": st.one_of(st.integers(-1, 40), scalars),
    "temperature": st.one_of(st.floats(-1, 3), st.sampled_from([0, 2, float("inf"), float("nan")]), scalars),
    "top_p": st.one_of(st.floats(-0.5, 1.5), scalars),
    "top_k": st.one_of(st.integers(-3, 500), scalars),
    "seed": st.one_of(st.integers(-(2**64), 2**64), scalars),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.one_of(st.text(max_size=4), scalars), max_size=3), scalars),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 1000), max_size=3), scalars),
    "n": st.one_of(st.integers(-1, 3), scalars),
    "stream": st.one_of(st.booleans(), scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "ignore_eos": st.one_of(st.booleans(), scalars),
    "min_tokens": st.one_of(st.integers(-1, 40), scalars),
    "skip_special_tokens": st.one_of(st.booleans(), scalars),
    "presence_penalty": st.one_of(st.sampled_from([0, 0.0, 1.5]), scalars),
    "frequency_penalty": st.one_of(st.sampled_from([0, -2.5]), scalars),
    "logprobs": st.one_of(st.sampled_from([None, False, 0, 1, True]), scalars),
    "user": st.one_of(st.text(max_size=8), scalars),
    "cache_salt": st.one_of(st.sampled_from(["tenant-a", "tenant-b", ""]), scalars),
    "echo": st.one_of(st.booleans(), scalars),
    "suffix": st.one_of(st.text(max_size=4), scalars),
    "best_of": st.one_of(st.integers(-1, 3), scalars),
    "tools": st.one_of(st.lists(json_values, max_size=2), scalars),
}

prompts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["The quick brown fox", "", SURROGATE, "café 🎉 日本", "x" * 300]),
    st.lists(st.integers(-2, 500), max_size=30),
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.lists(st.integers(0, 383), max_size=10), max_size=2),
    json_values,
)
contents = st.one_of(
    st.text(max_size=30),
    st.none(),
    st.sampled_from([SURROGATE, "Hello!", ""]),
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 1]), "text": st.text(max_size=10)}),
        max_size=2,
    ),
    json_values,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "", 7]), "content": contents}
        ),
        max_size=3,
    ),
    json_values,
)


# In range, so that a body made only of these is served (and runs through the engine).
VALID_VALUES = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "skip_special_tokens": st.booleans(),
    "presence_penalty": st.just(0),
    "user": st.text(max_size=8),
    "cache_salt": st.sampled_from(["tenant-a", "tenant-b"]),
}
valid_prompts = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 383), min_size=1, max_size=30))
valid_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}),
    min_size=1,
    max_size=3,
)


@st.composite
def near_valid(draw, chat: bool) -> dict:
    """Either a valid body (a third) or one whose fields come from the edges."""
    valid = draw(st.integers(0, 2)) == 0
    body: dict = {"model": draw(st.sampled_from([None, "tiny"]) if valid else MODELS)} if draw(st.booleans()) else {}
    if valid or draw(st.integers(0, 9)):  # usually present, sometimes missing
        body["messages" if chat else "prompt"] = draw(
            (valid_messages if chat else valid_prompts) if valid else (messages if chat else prompts)
        )
    values = VALID_VALUES if valid else FIELD_VALUES
    names = draw(st.lists(st.sampled_from(sorted(values)), max_size=5, unique=True))
    if valid:  # short outputs keep 2,000 bodies within a minute or two on a small CPU
        body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = draw(st.integers(1, 6))
    for name in names:
        body[name] = draw(values[name])
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.text(max_size=6))] = draw(json_values)  # unknown field
    return body


def encode(body) -> bytes:
    """JSON as a client would send it; NaN/Infinity as Python writes them, lone surrogates as \\u escapes."""
    return json.dumps(body).encode()


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"prompt": ',
            b"null",
            b"[]",
            b"1e999",
            b'"\\ud800"',
            b'{"prompt": "\\udc00x"}',
            b"[" * 1000 + b"]" * 1000,
            b'{"a":' * 600 + b"1" + b"}" * 600,
            b'{"max_tokens": ' + b"9" * 5000 + b"}",
            b"\xff\xfe{}",
            b'{"prompt": "hi", "temperature": NaN}',
            b'{"prompt": "hi", "seed": -Infinity}',
        ]
    ),
    json_values.map(encode),
)

PATHS = ["/v1/completions", "/v1/chat/completions"]


@st.composite
def requests(draw) -> tuple[str, bytes]:
    """(path, body bytes): a third raw or random, the rest near-valid for the path."""
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return path, draw(raw_bodies)
    return path, encode(draw(near_valid(chat=path.endswith("chat/completions"))))
