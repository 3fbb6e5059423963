"""Server-sent events for ``stream: true``: one chunk per choice and step, deltas that are never taken back.

Each choice (``index = prompt * n + sample``) keeps its own text deltas, the
count of tokens whose logprobs were sent and its finish; a chunk names one
choice, as vLLM's do. With ``echo``, a choice's first chunk starts with the
prompt (and its logprobs). The usage chunk comes last, once every engine
request of the batch has finished.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from ..sequence import CompletionOutput, RequestOutput
from .async_engine import EngineDeadError
from .choices import Batch, failure, usage
from .logprobs_format import CompletionLogprobs, chat_logprobs
from .protocol import APIError

__all__ = ["TextDeltas", "completion_stream", "chat_stream", "sse"]


class TextDeltas:
    """Turn the engine's full-text-so-far into deltas that never have to be taken back.

    While a request runs, trailing U+FFFD (an incomplete UTF-8 character) and the
    last ``len(longest stop string) - 1`` characters are held back: the engine
    truncates the text at a stop string once it is complete, and the start of
    one must not have been sent already. The final delta sends the rest.
    """

    def __init__(self, stop: list[str]) -> None:
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def __call__(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def dead(e: EngineDeadError) -> APIError:
    """The engine stopped (shutdown, or it died): 503, the request may be retried elsewhere."""
    return APIError(503, str(e), type="service_unavailable", code=503)


class _Choice:
    def __init__(self, stop: list[str], token_ids: bool = False) -> None:
        self.deltas = TextDeltas(stop)
        self.logprobs = CompletionLogprobs(token_ids)
        self.num_tokens = 0  # tokens whose logprobs were sent
        self.started = False
        self.done = False

    def new_tokens(self, comp: CompletionOutput) -> tuple[list[int], list]:
        ids, positions = comp.token_ids[self.num_tokens :], (comp.logprobs or [])[self.num_tokens :]
        self.num_tokens = len(comp.token_ids)
        return ids, positions


async def _choices(outputs: AsyncIterator[RequestOutput], batch: Batch, stop: list[str], finals: dict):
    """``(out, comp, index, state)`` for every unfinished choice of every output; errors become SSE events."""
    states: dict[int, _Choice] = {}
    async for out in outputs:
        if failure(out) is not None:
            raise failure(out)
        finals[out.request_id] = out
        for comp in out.outputs:
            index = batch.index(out, comp.index)
            state = states.setdefault(index, _Choice(stop, batch.token_ids))
            if not state.done:
                yield out, comp, index, state
                state.started, state.done = True, comp.finish_reason is not None


async def _stream(
    outputs: AsyncIterator[RequestOutput], batch: Batch, stop: list[str], base: dict, include_usage: bool, render
) -> AsyncIterator[str]:
    finals: dict[str, RequestOutput] = {}
    async with contextlib.aclosing(outputs), contextlib.aclosing(_choices(outputs, batch, stop, finals)) as choices:
        try:
            async for out, comp, index, state in choices:
                for chunk in render(out, comp, index, state):
                    yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(list(finals.values()), batch.echo_only)})
        except APIError as e:
            yield sse(e.body())
        except EngineDeadError as e:
            yield sse(dead(e).body())
    yield sse("[DONE]")


def completion_stream(
    outputs: AsyncIterator[RequestOutput], batch: Batch, base: dict, stop: list[str], include_usage: bool
) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def render(out: RequestOutput, comp: CompletionOutput, index: int, state: _Choice):
        finished = comp.finish_reason is not None
        text = "" if batch.echo_only else state.deltas(comp.text, finished)
        ids, positions = ([], []) if batch.echo_only else state.new_tokens(comp)
        echo = batch.echo(out)
        if echo is not None and not state.started:
            text = echo.text + text
            ids, positions = out.prompt_token_ids + ids, (out.prompt_logprobs or []) + positions
        lp = (
            None
            if batch.logprobs is None or not ids
            else state.logprobs(ids, positions, echo.first_token if echo else "")
        )
        if text or finished or lp:
            yield {
                **base,
                "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": comp.finish_reason}],
                **extra,
            }

    return _stream(outputs, batch, stop, base, include_usage, render)


async def chat_stream(
    outputs: AsyncIterator[RequestOutput], batch: Batch, base: dict, stop: list[str], include_usage: bool
) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
        return {
            **base,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            **extra,
        }

    def render(out: RequestOutput, comp: CompletionOutput, index: int, state: _Choice):
        finished = comp.finish_reason is not None
        text = state.deltas(comp.text, finished)
        ids, positions = state.new_tokens(comp)
        lp = None if batch.logprobs is None or not ids else chat_logprobs(ids, positions, batch.logprobs)
        if text or lp:
            yield chunk(index, {"content": text}, None, lp)
        if finished:
            yield chunk(index, {}, comp.finish_reason)

    for i in range(batch.n):
        yield sse(chunk(i, {"role": "assistant", "content": ""}, None))
    async for event in _stream(outputs, batch, stop, base, include_usage, render):
        yield event
