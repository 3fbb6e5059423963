"""The FastAPI app: routes, API-key check, body-size limit and OpenAI-shaped errors.

No request can make the app answer 500 or drop its connection: client errors
are 4xx before any work starts (:mod:`.body`, :mod:`.protocol`), and
:class:`ContainErrors` turns anything unexpected into one logged 500 instead
of letting the exception reach uvicorn, which would log a traceback and, with
it, may close the keep-alive connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .async_engine import AsyncEngine
from .body import read_json
from .metrics import ServerMetrics
from .openapi import ServedLimits, build_openapi, request_body, responses
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from .responses import ChatCompletionResponse, CompletionResponse, ModelList, Version
from .serving import OpenAIServing

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app", "kv_report", "ContainErrors"]

logger = logging.getLogger("qkv.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
OPEN_PATHS = ("/health", "/version", "/metrics")  # reachable without the API key, as in vLLM


class APIKeyMiddleware:
    """Pure ASGI (no response buffering, so streaming and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                resp = _error(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(
    status: int, message: str, type: str = "invalid_request_error", param=None, code=None, headers=None
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


class ContainErrors:
    """Outermost pure-ASGI layer: an exception never leaves the app.

    Starlette's own catch-all re-raises after answering 500, and uvicorn then
    logs a traceback per request and may drop the connection. Here an
    unexpected exception is logged once and answered with an OpenAI-shaped 500
    (if nothing was sent yet). A request task that uvicorn cancels, because it
    outlived ``--shutdown-timeout``, ends quietly with one log line.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            logger.warning("request %s %s cancelled at shutdown", scope.get("method"), scope.get("path"))
        except Exception as e:  # noqa: BLE001 - a bug of ours: one 500, the connection stays usable
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                resp = _error(500, f"internal error: {type(e).__name__}", "server_error", code=500)
                await resp(scope, receive, send)


def build_app(
    engine: AsyncEngine,
    model_names: list[str],
    metrics: ServerMetrics,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_root: str | None = None,
) -> FastAPI:
    serving = OpenAIServing(engine, model_names)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    # /openapi.json sits behind the API key like /v1 (it is not in OPEN_PATHS); no /docs: its page loads
    # Swagger UI from a CDN, which a loopback-only server cannot count on.
    app = FastAPI(title="qkv", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    limits = ServedLimits.of(engine.engine, model_names)
    schema: dict = {}

    def openapi() -> dict:
        if not schema:
            schema.update(build_openapi(app, limits, OPEN_PATHS, auth=api_key is not None))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to supply the document

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(ContainErrors)  # added last: the outermost of the app's own layers

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # scope["path"], not request.url: building a URL parses the Host header, which a client controls.
        return _error(
            exc.status_code,
            f"{request.method} {request.scope.get('path', '')}: {exc.detail}",
            kind,
            code=exc.status_code,
            headers=exc.headers,  # e.g. Allow on a 405
        )

    @app.get("/health", response_class=Response, responses=responses(None, 503))
    async def health():
        if not engine.alive:
            return _error(503, "the engine is not running", "service_unavailable", code=503)
        return Response(status_code=200)

    @app.get("/version", responses=responses(Version))
    async def version():
        return {"version": __version__}

    @app.get("/v1/models", responses=responses(ModelList))
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "qkv",
                    "root": model_root or name,
                    "parent": None,
                    "max_model_len": limits.max_model_len,
                }
                for name in model_names
            ],
        }

    @app.post(
        "/v1/completions",
        responses=responses(CompletionResponse, 400, 404, 413, 503, stream=True),
        openapi_extra=request_body(CompletionRequest),
    )
    async def completions(request: Request):
        return await serving.completions(request, await read_json(request, max_body_bytes))

    @app.post(
        "/v1/chat/completions",
        responses=responses(ChatCompletionResponse, 400, 404, 413, 503, stream=True),
        openapi_extra=request_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        return await serving.chat(request, await read_json(request, max_body_bytes))

    @app.get("/metrics", responses=responses(None, media="text/plain"))
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/kv", include_in_schema=False)
    async def debug_kv():
        """Block accounting of the paged cache, read on the engine thread between steps."""
        return await engine.call(kv_report)

    return app


def kv_report(engine) -> dict:
    pool = engine.pool
    referenced = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)  # block 0 is the null block
    return {
        "num_blocks": pool.num_blocks,
        "num_usable_blocks": pool.num_usable_blocks,
        "num_free_blocks": pool.num_free_blocks,
        "num_cached_blocks": len(pool.cached),
        "num_referenced_blocks": referenced,
        "num_shared_blocks": pool.num_shared_blocks(),  # ref count > 1: parallel samples share the prompt
        "num_cow_copies": engine.kv_manager.num_copies,
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "num_unfinished_requests": len(engine.requests),
        "offload": engine.offload.report() if engine.offload is not None else None,
    }
