"""The response bodies, as pydantic models: what ``/openapi.json`` promises for each status.

The handlers build these bodies as plain dicts (:mod:`.choices`, :mod:`.streaming`); the models here
describe them for the published schema, and a fuzzer that reads that schema (schemathesis, in CI)
checks every response it gets against them. A field the handlers add must be added here, or the
fuzzer reports the response as breaking the schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = [
    "ChatCompletionResponse",
    "CompletionResponse",
    "ErrorResponse",
    "ModelList",
    "Version",
]

FinishReason = Literal["stop", "length", "abort"] | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0, description="prompt tokens served from the prefix cache or the offload tier")


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Per token: its text, its logprob (None for a prompt's first token) and the top alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = Field(ge=0, description="prompt * n + sample")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None = None
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Version(BaseModel):
    version: str
