"""``/v1/completions`` and ``/v1/chat/completions``: request -> engine requests -> OpenAI JSON or SSE chunks.

A completion request's prompts (one, or a list, as OpenAI and vLLM take them)
become one engine request each, all delivering to one queue; the choices of
their samples are numbered and rendered by :mod:`.choices`, and streamed by
:mod:`.streaming`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..engine import RequestError
from ..sequence import RequestOutput
from .async_engine import AsyncEngine, EngineDeadError
from .choices import Batch, Echo, failure
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from .streaming import chat_stream, completion_stream, dead

__all__ = ["OpenAIServing"]

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
        raise APIError(
            404,
            f"The model `{shown}` does not exist. Served: {', '.join(self.model_names)}",
            param="model",
            code="model_not_found",
        )

    # -- entry points ---------------------------------------------------------
    async def completions(self, request: Request, data: object) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, data)
        model = self.check_model(req.model)
        prompts: list = req.prompts()
        params = req.sampling_params(req.engine_max_tokens)
        echoes = [Echo() for _ in prompts] if req.echo else None
        if echoes is not None:  # the prompt's text and first token are read on the engine thread
            prompts = [e.resolver(p) for e, p in zip(echoes, prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        batch = Batch(ids, params.n, params.logprobs, echoes, req.echo_only, req.return_tokens_as_token_ids)
        return await self._serve(request, req, rid, batch, model, prompts, params, "prompt", chat=False)

    async def chat(self, request: Request, data: object) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, data)
        model = self.check_model(req.model)
        messages = req.template_messages()
        params = req.sampling_params(req.effective_max_tokens)

        def render(engine) -> list[int]:  # runs on the engine thread: tokenizers are not thread-safe
            tok = engine.tokenizer
            if not getattr(tok, "chat_template", None):
                raise ValueError("this model has no chat template; use /v1/completions")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # The template already holds any BOS: do not add special tokens again (as vLLM does).
            return tok(text, add_special_tokens=False)["input_ids"]

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        batch = Batch([rid], params.n, params.logprobs)
        return await self._serve(request, req, rid, batch, model, [render], params, "messages", chat=True)

    # -- common path ------------------------------------------------------------
    async def _add(self, req, batch: Batch, prompts: list, params, queue: asyncio.Queue) -> None:
        """Add every prompt's engine request, or none: a refused prompt aborts those added before it."""
        arrival = time.monotonic()
        added: list[str] = []
        try:
            for rid, prompt in zip(batch.ids, prompts):
                # strict_max_tokens: a max_tokens past the context is a 400, as in vLLM, not silently clamped.
                await self.engine.add(
                    rid, prompt, params, arrival, queue=queue, cache_salt=req.cache_salt, strict_max_tokens=True
                )
                added.append(rid)
        except BaseException:
            self._abort(added)
            raise

    async def _serve(
        self,
        request: Request,
        req,
        rid: str,
        batch: Batch,
        model: str,
        prompts: list,
        params,
        prompt_param: str,
        chat: bool,
    ) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        try:
            await self._add(req, batch, prompts, params, queue)
        except EngineDeadError as e:
            raise dead(e) from None
        except RequestError as e:
            param = prompt_param if e.param == "prompt" else req.param_name(e.param) or e.param
            raise APIError(400, str(e), param=param, code=e.code) from None
        except ValueError as e:  # e.g. no chat template
            raise APIError(400, str(e), param=prompt_param) from None
        except Exception as e:  # e.g. a chat template that rejects the roles given
            raise APIError(400, f"cannot build the prompt: {type(e).__name__}: {e}", param=prompt_param) from None
        outputs = self.engine.outputs(batch.ids, queue)
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        if req.stream:
            stream = chat_stream if chat else completion_stream
            # The background abort covers a client gone before the stream's first chunk (the generators'
            # own clean-up never runs then); for finished requests it is a no-op.
            return StreamingResponse(
                stream(outputs, batch, base, params.stop, req.include_usage),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
                background=BackgroundTask(self._abort, batch.ids),
            )
        finals = await _until_done_or_disconnect(request, outputs)
        if finals is None:  # client left: the requests were aborted
            return Response(status_code=499)
        for out in finals.values():
            if failure(out) is not None:
                raise failure(out)
        choices = batch.chat_choices(finals) if chat else batch.completion_choices(finals)
        return JSONResponse(
            {
                **base,
                "object": "chat.completion" if chat else "text_completion",
                "choices": choices,
                "usage": batch.usage(finals),
            }
        )

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)


async def _until_done_or_disconnect(
    request: Request, outputs: AsyncIterator[RequestOutput]
) -> dict[str, RequestOutput] | None:
    """Run non-streaming requests to the end (their last outputs by id); abort them if the client leaves first."""

    async def collect() -> dict[str, RequestOutput]:
        last: dict[str, RequestOutput] = {}
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                last[out.request_id] = out
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
        if not work.done():  # the client left (or this handler was cancelled): abort the requests
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return None
    try:
        return work.result()
    except EngineDeadError as e:
        raise dead(e) from None
