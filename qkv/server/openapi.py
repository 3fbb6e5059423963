"""``/openapi.json``: the contract of one running ``qkv serve``, built from the pydantic models.

Request bodies are the models that validate them (:mod:`.protocol`), so the schema and the
validator cannot drift apart; responses are :mod:`.responses`. The handlers read their bodies
themselves (size limit, depth limit, lone surrogates: :mod:`.body`), so the request schemas are
attached to the operations here rather than through FastAPI's body parameters.

Some limits belong to the served engine, not to the models, and are filled in per server
(:class:`ServedLimits`): the model names, the vocabulary (token ids), ``max_model_len``
(``max_tokens``) and ``max_num_seqs`` (``n``, ``best_of``). Rules that relate two fields are beyond
JSON Schema and are stated in the fields' descriptions: a prompt's tokens plus ``max_tokens`` fit in
``max_model_len``, ``min_tokens`` <= ``max_tokens``, ``best_of`` >= ``n``, ``max_tokens: 0`` only
with ``echo``, ``top_logprobs`` only with ``logprobs: true``. The chat operation is published only
when the model has a chat template: without one every chat request is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from ..sampling import MAX_SAMPLES
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ErrorResponse

__all__ = ["ServedLimits", "build_openapi", "request_body", "responses", "CHAT_PATH"]

CHAT_PATH = "/v1/chat/completions"
_REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class ServedLimits:
    """What the served engine accepts beyond the request models' own bounds."""

    model_names: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    max_samples: int  # n and best_of: min(MAX_SAMPLES, max_num_seqs)
    chat: bool  # the tokenizer has a chat template

    @classmethod
    def of(cls, engine, model_names: list[str]) -> ServedLimits:
        """The limits of an ``LLMEngine``."""
        return cls(
            model_names=tuple(model_names),
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
            max_samples=min(MAX_SAMPLES, engine.config.max_num_seqs),
            chat=bool(getattr(engine.tokenizer, "chat_template", None)),
        )


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of a route whose handler reads ``model`` from the JSON body itself."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (or an error object); [DONE] last"}},
}

_ERRORS = {
    400: "the request is malformed, or asks for something this server does not do (the message names the field)",
    401: "a missing or wrong API key (only where the server was started with --api-key)",
    404: "the model named is not served",
    413: "the request body is over --max-request-body",
    503: "the engine is not running (it is shutting down, or it failed); retry elsewhere",
}


def responses(ok: type[BaseModel] | None, *errors: int, stream: bool = False, media: str | None = None) -> dict:
    """The ``responses=`` of a route: its 200 and the OpenAI-shaped errors it can answer."""
    out: dict = {}
    if ok is not None:
        out[200] = {"model": ok, "description": "success"}
        if stream:  # stream: true answers server-sent events; in OpenAPI 3.1 `schema` describes one event
            out[200]["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    elif media is not None:
        out[200] = {"description": "success", "content": {media: {"schema": {"type": "string"}}}}
    else:
        out[200] = {"description": "success (no body)"}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERRORS[status]}
    return out


def build_openapi(app: FastAPI, limits: ServedLimits, open_paths: tuple[str, ...], auth: bool) -> dict:
    """The document ``/openapi.json`` serves (built once, on its first request)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=__doc__.split("\n\n")[0])
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        _apply(schema["properties"], limits)
    if not limits.chat:
        doc["paths"].pop(CHAT_PATH, None)
        schemas.pop(ChatCompletionRequest.__name__)
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc["paths"].items():
            for op in ops.values():
                op["security"] = [] if path in open_paths else [{"bearer": []}]
                if path not in open_paths:
                    op.setdefault("responses", {})["401"] = {
                        "description": _ERRORS[401],
                        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
                    }
    return doc


def _apply(props: dict, limits: ServedLimits) -> None:
    """Write the served engine's limits into a request schema's properties."""
    _narrow(props["model"], "string", enum=list(limits.model_names))
    for name in ("n", "best_of"):
        _narrow(props[name], "integer", maximum=limits.max_samples)
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:  # a prompt holds at least one token
            _narrow(props[name], "integer", maximum=limits.max_model_len - 1)
    if "prompt" in props:  # stop_token_ids stay unbounded: an id the model never samples is harmless
        _narrow(props["prompt"], "integer", maximum=limits.vocab_size - 1)


def _narrow(schema: dict, type_: str, **bounds) -> None:
    """Add ``bounds`` to every sub-schema of type ``type_`` inside ``schema`` (unions and arrays included)."""
    if schema.get("type") == type_:
        schema.update(bounds)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            _narrow(sub, type_, **bounds)
    if isinstance(schema.get("items"), dict):
        _narrow(schema["items"], type_, **bounds)
