"""One HTTP request's engine requests (a batch of prompts, each with ``n`` samples) and their choices.

A completion request may carry a list of prompts; each becomes an engine
request, and its samples become choices numbered ``index = prompt * n +
sample``, as OpenAI and vLLM number them. A chat request is a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..sequence import RequestOutput
from .logprobs_format import CompletionLogprobs, chat_logprobs
from .protocol import APIError

__all__ = ["Batch", "Echo", "usage", "failure"]


@dataclass
class Echo:
    """A prompt's text and its first token's text, for ``echo`` (filled on the engine thread)."""

    text: str = ""
    first_token: str = ""

    def resolver(self, prompt: str | list[int]) -> Callable:
        """A prompt callable for :meth:`AsyncEngine.add`: runs on the engine thread, where the tokenizer
        may be used, fills this object and returns the prompt's token ids (invalid ids are returned as
        they are, for ``add_request`` to refuse with its usual message)."""

        def resolve(engine) -> list[int]:
            ids = engine.tokenize(prompt)
            if ids and all(type(t) is int and 0 <= t < engine.vocab_size for t in ids):
                self.text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
                self.first_token = engine.token_text(ids[0])
            return ids

        return resolve


@dataclass
class Batch:
    """The engine requests of one HTTP request, in prompt order, and how their choices are rendered."""

    ids: list[str]
    n: int
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    echoes: list[Echo] | None = None  # completions with echo: one per prompt
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    token_ids: bool = False  # logprobs name tokens "token_id:N" (return_tokens_as_token_ids)
    prompt_of: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_of = {rid: i for i, rid in enumerate(self.ids)}

    def index(self, out: RequestOutput, sample: int) -> int:
        return self.prompt_of[out.request_id] * self.n + sample

    def echo(self, out: RequestOutput) -> Echo | None:
        return None if self.echoes is None else self.echoes[self.prompt_of[out.request_id]]

    def completion_choices(self, finals: dict[str, RequestOutput]) -> list[dict]:
        choices = []
        for rid in self.ids:
            out = finals[rid]
            echo = self.echo(out)
            for comp in out.outputs:
                text = "" if self.echo_only else comp.text
                ids, positions = ([], []) if self.echo_only else (comp.token_ids, comp.logprobs or [])
                if echo is not None:
                    text = echo.text + text
                    ids, positions = out.prompt_token_ids + ids, (out.prompt_logprobs or []) + positions
                lp = (
                    None
                    if self.logprobs is None
                    else CompletionLogprobs(self.token_ids)(ids, positions, echo.first_token if echo else "")
                )
                choices.append(
                    {
                        "index": self.index(out, comp.index),
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": comp.finish_reason,
                    }
                )
        return sorted(choices, key=lambda c: c["index"])

    def chat_choices(self, finals: dict[str, RequestOutput]) -> list[dict]:
        out = finals[self.ids[0]]
        return [
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": None
                if self.logprobs is None
                else chat_logprobs(comp.token_ids, comp.logprobs or [], self.logprobs),
                "finish_reason": comp.finish_reason,
            }
            for comp in sorted(out.outputs, key=lambda c: c.index)
        ]

    def usage(self, finals: dict[str, RequestOutput]) -> dict:
        return usage(list(finals.values()), self.echo_only)


def usage(finals: list[RequestOutput], echo_only: bool = False) -> dict:
    """OpenAI's usage: each prompt counted once, the completion tokens of every returned choice."""
    p = sum(len(out.prompt_token_ids) for out in finals)
    c = 0 if echo_only else sum(len(comp.token_ids) for out in finals for comp in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def failure(out: RequestOutput) -> APIError | None:
    """The engine aborted this request because it failed on it (a bug of ours, so a 500)."""
    error = next((c.error for c in out.outputs if c.error is not None), None)
    return (
        None
        if error is None
        else APIError(500, f"the engine failed on this request: {error}", type="server_error", code=500)
    )
