"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Fields are validated strictly: a string where a number belongs is a 400, not a
silent coercion, and numbers are checked against the ranges OpenAI and vLLM
use (``temperature`` 0 to 2, finite; ``seed`` a signed 64-bit integer).
Unknown fields are ignored, as OpenAI-compatible servers do. Besides OpenAI's
fields, the vLLM extensions ``top_k``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``, ``cache_salt`` and ``best_of`` on
chat are accepted (the ``openai`` client sends them through ``extra_body``).

``n``/``best_of`` run parallel samples (``best_of`` > ``n`` only without
streaming: the best are known at the end). Logprobs follow OpenAI: on chat
``logprobs: true`` and ``top_logprobs: k``; on completions ``logprobs: k``, and
with ``echo`` the prompt's logprobs too (``max_tokens: 0`` with ``echo`` returns
the prompt alone, as vLLM does). ``k`` is at most 20.

These models are also the request schemas of ``/openapi.json`` (:mod:`.openapi`), so a limit the server
enforces is written on the field, where the schema shows it. Values a field's type admits but qkv refuses
with a message of its own (``suffix``, ``tools``, the penalties, ``logprobs: true``) carry a
``WithJsonSchema`` that states the narrower rule.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, WithJsonSchema

from ..sampling import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "error_body", "parse_request"]


class APIError(Exception):
    """An error the client caused (or is told about), rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> dict:
    """OpenAI's error object. Text that echoes client input is made encodable (a lone surrogate becomes
    the six characters ``\\ud800``), so rendering an error can never fail in its turn."""
    return {"error": {"message": printable(message), "type": type, "param": printable(param), "code": code}}


def printable(text):
    """``text`` with anything UTF-8 cannot encode backslash-escaped; other values unchanged."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _finite(ge: float | None = None, le: float | None = None, gt: float | None = None):
    return Annotated[float, Field(ge=ge, le=le, gt=gt, allow_inf_nan=False)]


_INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_TOP = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
_SAMPLES = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]  # the served engine may lower the bound (.openapi)
TOKEN_ID = Annotated[int, Field(ge=0)]  # below the vocabulary size: checked by the engine, stated by .openapi
_TEXT = Annotated[str, Field(min_length=1)]


def _refused(schema: dict, why: str):
    """A field whose type admits more than qkv serves: the schema states only what is accepted."""
    return WithJsonSchema({**schema, "description": why})


def _stated(strict, why: str | None = None):
    """Publish ``strict``'s schema on a field validated more loosely, where the server's own check gives a
    clearer message than pydantic's error for a branch of a union (an empty stop string, a negative id)."""
    schema = TypeAdapter(strict).json_schema()
    return WithJsonSchema(schema if why is None else {**schema, "description": why})


_NO_TOOLS = _refused({"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}, "not supported by qkv")
_ZERO_ONLY = _refused({"anyOf": [{"const": 0}, {"type": "null"}]}, "not supported by qkv: only 0 is accepted")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: _finite(ge=0, le=2) | None = None  # OpenAI's range
    top_p: _finite(gt=0, le=1) | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # 0 or -1: off
    seed: _INT64 | None = None  # vLLM's range
    stop: Annotated[str | list[str] | None, _stated(_TEXT | list[_TEXT] | None)] = None
    stop_token_ids: Annotated[list[int] | None, _stated(list[TOKEN_ID] | None)] = None
    n: _SAMPLES | None = None
    best_of: _SAMPLES | None = Field(None, description="at least n; with stream, equal to n")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, description="at most max_tokens")] = 0
    skip_special_tokens: bool = True
    presence_penalty: Annotated[_finite(ge=-2, le=2) | None, _ZERO_ONLY] = None
    frequency_penalty: Annotated[_finite(ge=-2, le=2) | None, _ZERO_ONLY] = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM: isolates this tenant's prefix cache

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by qkv (send 0 or leave it out)", param=name)
        n = 1 if self.n is None else self.n
        if self.stream and self.best_of is not None and self.best_of != n:
            raise APIError(
                400,
                f"best_of must equal n ({n}) when streaming: which samples are the best is "
                f"known only when all have finished",
                param="best_of",
            )

    def sample_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: how many alternatives per sampled token (None: no logprobs)."""
        return None

    def prompt_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Build engine sampling params; their validation errors become 400s naming the field."""
        try:
            return SamplingParams(
                n=1 if self.n is None else self.n,
                best_of=self.best_of,
                logprobs=self.sample_logprobs(),
                prompt_logprobs=self.prompt_logprobs(),
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as e:  # SamplingParams' messages start with the field's name
            first = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=self.param_name(first)) from None

    def param_name(self, field: str | None) -> str | None:
        """The request field a sampling field came from (None if it is not one)."""
        return field if field in type(self).model_fields else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_PROMPT_WHY = "its tokens plus max_tokens must fit in max_model_len"


def _implies(field: str, when: dict, other: str, value) -> dict:
    """JSON Schema for "if ``field`` matches ``when``, ``other`` must be ``value``" (a rule across two fields)."""
    return {
        "if": {"required": [field], "properties": {field: when}},
        "then": {"required": [other], "properties": {other: {"const": value}}},
    }


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [_implies("max_tokens", {"const": 0}, "echo", True)]})

    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]],
        _stated(
            _TEXT
            | Annotated[list[TOKEN_ID], Field(min_length=1)]
            | Annotated[list[_TEXT], Field(min_length=1)]
            | Annotated[list[Annotated[list[TOKEN_ID], Field(min_length=1)]], Field(min_length=1)],
            f"a text, token ids, or a batch of either; for each prompt, {_PROMPT_WHY}",
        ),
    ]
    # OpenAI's default for completions; 0 only with echo (the prompt alone)
    max_tokens: Annotated[int, Field(ge=0, description="0 only with echo")] | None = 16
    echo: bool = False
    suffix: Annotated[str | None, _refused({"anyOf": [{"const": ""}, {"type": "null"}]}, "not supported by qkv")] = None
    # OpenAI: an integer; false is taken as none, true is refused
    logprobs: Annotated[
        _TOP | bool | None,
        _refused(
            {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}, {"const": False}, {"type": "null"}]},
            "alternatives per token; false or null: none",
        ),
    ] = None
    # vLLM's extension: logprobs name tokens "token_id:N" instead of their text, so that two tokens that
    # decode alike stay apart (qkv eval --server scores this way)
    return_tokens_as_token_ids: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, token ids, or a list of either (choice index = prompt * n + sample)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for one in batch:
            if isinstance(one, list) and not one or one == "":
                raise APIError(400, "prompt is empty: give at least one token", param="prompt")
        return batch

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens  # vLLM too generates one token, then drops it

    def sample_logprobs(self) -> int | None:
        return None if self.logprobs is False else self.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.sample_logprobs() if self.echo else None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is True:
            raise APIError(
                400,
                f"logprobs on /v1/completions is the number of alternatives per token, "
                f"an integer in [0, {MAX_LOGPROBS}], not true",
                param="logprobs",
            )
        if self.suffix:
            raise APIError(400, "suffix is not supported by qkv", param="suffix")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={"allOf": [_implies("top_logprobs", {"type": "integer", "minimum": 1}, "logprobs", True)]}
    )

    messages: Annotated[
        list[ChatMessage], Field(min_length=1, description=f"rendered by the model's chat template; {_PROMPT_WHY}")
    ]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Annotated[list | None, _NO_TOOLS] = None
    logprobs: bool | None = None
    top_logprobs: _TOP | None = Field(None, description="needs logprobs: true")

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def param_name(self, field: str | None) -> str | None:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param_name(field)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported by qkv", param="tools")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def parse_request(cls: type[_SamplingFields], data: object) -> _SamplingFields:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        raise APIError(400, f"invalid field '{where}': {err['msg']}", param=param) from None
    req.check_unsupported()
    return req
