"""``/v1/completions`` and ``/v1/chat/completions``: request -> engine -> OpenAI JSON or SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..engine import RequestError
from ..sequence import RequestOutput
from .async_engine import AsyncEngine, EngineDeadError
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

__all__ = ["OpenAIServing"]

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
        delta, self.sent = text[self.sent:end], end
        return delta


def _usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def _finish_reason(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


def _failure(out: RequestOutput) -> APIError | None:
    """The engine aborted this request because it failed on it (a bug of ours, so a 500)."""
    error = out.outputs[0].error
    return None if error is None else APIError(500, f"the engine failed on this request: {error}",
                                               type="server_error", code=500)


def _dead(e: EngineDeadError) -> APIError:
    """The engine stopped (shutdown, or it died): 503, the request may be retried elsewhere."""
    return APIError(503, str(e), type="service_unavailable", code=503)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return self.model_name if name is None else name
        shown = name if len(name) <= 200 else name[:200] + "..."
        raise APIError(404, f"The model `{shown}` does not exist. Served: {', '.join(self.model_names)}",
                       param="model", code="model_not_found")

    # -- entry points ---------------------------------------------------------
    async def completions(self, request: Request, data: object) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, data)
        model = self.check_model(req.model)
        prompt = req.single_prompt()
        params = req.sampling_params(req.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await self._serve(request, req, rid, model, prompt, params, "prompt", chat=False)

    async def chat(self, request: Request, data: object) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, data)
        model = self.check_model(req.model)
        messages = req.template_messages()
        params = req.sampling_params(req.effective_max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def render(engine) -> list[int]:  # runs on the engine thread: tokenizers are not thread-safe
            tok = engine.tokenizer
            if not getattr(tok, "chat_template", None):
                raise ValueError("this model has no chat template; use /v1/completions")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # The template already holds any BOS: do not add special tokens again (as vLLM does).
            return tok(text, add_special_tokens=False)["input_ids"]

        return await self._serve(request, req, rid, model, render, params, "messages", chat=True)

    # -- common path ------------------------------------------------------------
    async def _serve(self, request: Request, req, rid: str, model: str, prompt, params, prompt_param: str,
                     chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            # strict_max_tokens: a max_tokens past the context is a 400, as in vLLM, not silently clamped.
            q = await self.engine.add(rid, prompt, params, arrival, cache_salt=req.cache_salt,
                                      strict_max_tokens=True)
        except EngineDeadError as e:
            raise _dead(e) from None
        except RequestError as e:
            param = prompt_param if e.param == "prompt" else req.param_name(e.param) or e.param
            raise APIError(400, str(e), param=param, code=e.code) from None
        except ValueError as e:  # e.g. no chat template
            raise APIError(400, str(e), param=prompt_param) from None
        except Exception as e:  # e.g. a chat template that rejects the roles given
            raise APIError(400, f"cannot build the prompt: {type(e).__name__}: {e}", param=prompt_param) from None
        outputs = self.engine.outputs(rid, q)
        created = int(time.time())
        if req.stream:
            gen = self._chat_stream if chat else self._completion_stream
            # The background abort covers a client gone before the stream's first chunk (the generators'
            # own clean-up never runs then); for a finished request it is a no-op.
            return StreamingResponse(gen(outputs, rid, model, created, params.stop, req.include_usage),
                                     media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(self.engine.abort, rid))
        final = await _until_done_or_disconnect(request, outputs)
        if final is None:  # client left: the request was aborted
            return Response(status_code=499)
        failure = _failure(final)
        if failure is not None:
            raise failure
        comp = final.outputs[0]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": comp.text},
                      "logprobs": None, "finish_reason": comp.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": comp.text, "logprobs": None, "finish_reason": comp.finish_reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                             "choices": [choice], "usage": _usage(final)})

    async def _completion_stream(self, outputs: AsyncIterator[RequestOutput], rid: str, model: str,
                                 created: int, stop: list[str], include_usage: bool) -> AsyncIterator[str]:
        deltas = TextDeltas(stop)
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    if _failure(out) is not None:
                        yield _sse(_failure(out).body())
                        break
                    text = deltas(out.outputs[0].text, out.finished)
                    if text or out.finished:
                        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(out)}
                        yield _sse({**base, "choices": [choice], **extra})
                    if out.finished and include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(out)})
            except EngineDeadError as e:
                yield _sse(_dead(e).body())
        yield _sse("[DONE]")

    async def _chat_stream(self, outputs: AsyncIterator[RequestOutput], rid: str, model: str,
                           created: int, stop: list[str], include_usage: bool) -> AsyncIterator[str]:
        deltas = TextDeltas(stop)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}

        def chunk(delta: dict, finish: str | None) -> str:
            return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}], **extra})

        yield chunk({"role": "assistant", "content": ""}, None)
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    if _failure(out) is not None:
                        yield _sse(_failure(out).body())
                        break
                    text = deltas(out.outputs[0].text, out.finished)
                    if text:
                        yield chunk({"content": text}, None)
                    if out.finished:
                        yield chunk({}, _finish_reason(out))
                        if include_usage:
                            yield _sse({**base, "choices": [], "usage": _usage(out)})
            except EngineDeadError as e:
                yield _sse(_dead(e).body())
        yield _sse("[DONE]")


async def _until_done_or_disconnect(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Run a non-streaming request to the end, aborting it if the client disconnects first."""

    async def collect() -> RequestOutput:
        async with contextlib.aclosing(outputs):
            last = None
            async for last in outputs:  # noqa: B007 - the loop keeps the last output
                pass
            return last

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client left (or this handler was cancelled): abort the request
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return None
    try:
        return work.result()
    except EngineDeadError as e:
        raise _dead(e) from None
