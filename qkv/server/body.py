"""Reading a request body as JSON, refusing with a 400 what would otherwise fail deep inside the server.

``json.loads`` raises ``RecursionError`` on a few kilobytes of ``[[[[...``,
a plain ``ValueError`` on integers past Python's 4,300-digit limit, and
accepts lone surrogates (``"\\ud800"``), which no UTF-8 encoder, tokenizer or
JSON response can handle later. All of these are the client's problem, so
they are answered here, before pydantic sees the body: the body is parsed,
then walked once, iteratively, to bound its nesting and check its strings.

A number written with a fraction or exponent that is a whole number (``2.0``, ``1e2``) is read as an
integer: JSON Schema calls it one, so ``/openapi.json``'s ``integer`` fields must take it, while the
request models stay strict about strings and booleans.
"""

from __future__ import annotations

import json

from starlette.requests import Request

from .protocol import APIError

__all__ = ["MAX_JSON_DEPTH", "read_json", "check_json"]

MAX_JSON_DEPTH = 32  # an OpenAI body nests 5 deep (chat content parts); tool schemas a little more


async def read_json(request: Request, limit: int) -> object:
    """The body as checked JSON, or an :class:`APIError`: 413 past ``limit`` bytes, 400 if it is not fit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body, parse_float=_number)
    except RecursionError:
        raise APIError(
            400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers too long to convert
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    check_json(data)
    return data


def _number(text: str) -> int | float:
    x = float(text)
    return int(x) if x.is_integer() else x  # inf and nan are not integers, and stay floats to be refused


def check_json(data: object, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 :class:`APIError` for nesting deeper than ``max_depth`` or a string that is not valid
    Unicode (a lone surrogate); ``param`` is the top-level field it was found under."""
    stack: list[tuple[object, int, str | None]] = [(data, 1, None)]
    while stack:
        obj, depth, field = stack.pop()
        if isinstance(obj, str):
            _check_text(obj, field)
            continue
        if depth > max_depth:
            raise APIError(
                400, f"the request body is nested more than {max_depth} levels deep", param=field, code="invalid_json"
            )
        if isinstance(obj, dict):
            for key, value in obj.items():
                _check_text(key, field)
                if isinstance(value, (dict, list, str)):
                    stack.append((value, depth + 1, key if field is None else field))
        elif isinstance(obj, list):
            stack.extend((v, depth + 1, field) for v in obj if isinstance(v, (dict, list, str)))


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = "the request body" if field is None else f"'{field}'"
        raise APIError(
            400,
            f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X}), which is not valid Unicode text",
            param=field,
        ) from None
