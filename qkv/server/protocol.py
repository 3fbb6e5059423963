"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Fields are validated strictly: a string where a number belongs is a 400, not a
silent coercion, and numbers are checked against the ranges OpenAI and vLLM
use (``temperature`` 0 to 2, finite; ``seed`` a signed 64-bit integer).
Unknown fields are ignored, as OpenAI-compatible servers do. Besides OpenAI's
fields, the vLLM extensions ``top_k``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens`` and ``cache_salt`` are accepted
(the ``openai`` client sends them through ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling import SamplingParams

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "error_body", "parse_request"]


class APIError(Exception):
    """An error the client caused (or is told about), rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
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


_INT64 = Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: _finite(ge=0, le=2) | None = None  # OpenAI's range
    top_p: _finite(gt=0, le=1) | None = None
    top_k: int | None = None
    seed: _INT64 | None = None  # vLLM's range
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    presence_penalty: _finite(ge=-2, le=2) | None = None
    frequency_penalty: _finite(ge=-2, le=2) | None = None
    logprobs: bool | int | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM: isolates this tenant's prefix cache

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by qkv (send 0 or leave it out)", param=name)
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by qkv", param="logprobs")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Build engine sampling params; their validation errors become 400s naming the field."""
        try:
            return SamplingParams(
                n=1 if self.n is None else self.n,
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


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"got {len(p)} prompts; qkv takes one prompt per request", param="prompt")
            p = p[0]
        if isinstance(p, list) and not p or p == "":
            raise APIError(400, "prompt is empty: give at least one token", param="prompt")
        return p

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by qkv", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by qkv", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")


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
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list | None = None

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
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
