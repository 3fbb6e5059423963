"""schemathesis hooks (``SCHEMATHESIS_HOOKS=support.schemathesis_hooks``): the four rules of ``/openapi.json``
that relate two fields, which JSON Schema cannot state and its descriptions do.

Only schema-valid ("positive") cases are filtered, and only when they break one of these rules; the
server must then refuse them, which the negative cases and tests/server/test_server.py check. Everything
else the fuzzer sends is generated from the published schema alone. The served model's directory and
``max_model_len`` come from the environment the test sets.
"""

from __future__ import annotations

import os

import schemathesis
from transformers import AutoTokenizer

_TOKENIZER = AutoTokenizer.from_pretrained(os.environ["QKV_FUZZ_MODEL"])
_MAX_MODEL_LEN = int(os.environ["QKV_FUZZ_MAX_MODEL_LEN"])


def _tokens(prompt) -> int:
    """An upper bound on the engine's token count: the tokenizer's, plus a BOS it may add."""
    if isinstance(prompt, str):
        return len(_TOKENIZER(prompt)["input_ids"]) + 1
    return len(prompt)


def _prompts(path: str, body: dict) -> list:
    if path.endswith("/chat/completions"):
        messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in body["messages"]]
        return [_TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)]
    p = body["prompt"]
    return p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


def _text(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def fits(path: str, body: dict) -> bool:
    """Whether ``body`` keeps the four cross-field rules (a prompt fits with max_tokens, min_tokens <=
    max_tokens, best_of >= n, best_of == n when streaming)."""
    chat = path.endswith("/chat/completions")
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)
    n, best_of = body.get("n") or 1, body.get("best_of")
    if best_of is not None and (best_of < n or (body.get("stream") and best_of != n)):
        return False
    if max_tokens is not None and body.get("min_tokens", 0) > max_tokens:
        return False
    room = _MAX_MODEL_LEN - (max_tokens or 0)
    return all(_tokens(p) <= room for p in _prompts(path, body))


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    meta = case.meta
    positive = meta is None or meta.generation.mode.is_positive
    if not positive or case.method.upper() != "POST" or not isinstance(case.body, dict):
        return True
    return fits(case.path, case.body)
