"""``qkv serve MODEL``: load the engine, then run the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import uvicorn

from ..config_flags import add_engine_args, engine_kwargs

__all__ = ["add_serve_args", "serve", "GracefulServer"]

logger = logging.getLogger("qkv.server")

# After --shutdown-timeout, requests still running are ended by the engine (streams get an error event and
# [DONE]); uvicorn cancels whatever is left only this much later, so those last events reach the clients.
CUT_MARGIN_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown ends overdue requests cleanly instead of cancelling them.

    On SIGTERM uvicorn stops accepting connections and waits for the running
    requests; past its timeout it cancels their tasks, which cuts a stream
    mid-chunk (the client sees an incomplete chunked read) and logs a
    ``CancelledError`` traceback per request. Here, at ``shutdown_timeout``,
    the engine is stopped first: every request still running gets "the server
    is shutting down", which a stream sends as an SSE error event followed by
    ``data: [DONE]`` and a plain request as a 503. uvicorn's own timeout is
    set ``CUT_MARGIN_S`` later, as a backstop.
    """

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout + CUT_MARGIN_S
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        cut = asyncio.ensure_future(self._cut_after_timeout())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _cut_after_timeout(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        logger.warning("--shutdown-timeout of %.1f s reached: ending the requests still running", self.shutdown_timeout)
        await self.engine.stop()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("QKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $QKV_API_KEY; /health stays open)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the MODEL argument); the first is reported",
    )
    p.add_argument("--max-request-body", default="1MiB", help="largest accepted request body (413 beyond)")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines while busy")
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, wait this long for in-flight requests, then end them with an error "
        "(streams: an SSE error event and [DONE])",
    )


def serve(args: argparse.Namespace) -> int:
    from ..config import EngineConfig, parse_size
    from ..engine import LLMEngine
    from .app import build_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics

    try:
        max_body = parse_size(args.max_request_body)
    except ValueError as e:
        raise ValueError(f"--max-request-body: {e}") from None
    if max_body <= 0:
        raise ValueError(f"--max-request-body must be > 0, got {args.max_request_body!r}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    names = args.served_model_name or [args.model]
    engine = LLMEngine(EngineConfig(model=args.model, **engine_kwargs(args)))
    metrics = ServerMetrics(names[0])
    async_engine = AsyncEngine(engine, metrics, log_interval=args.log_interval, log_stats=not args.disable_log_stats)
    app = build_app(
        async_engine,
        names,
        metrics,
        api_key=args.api_key or None,
        max_body_bytes=max_body,
        max_model_len=engine.max_model_len,
        model_root=str(engine.model_path),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=not args.disable_uvicorn_access_log,
        lifespan="on",
    )
    server = GracefulServer(config, async_engine, args.shutdown_timeout)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal it caught once its own
    # handlers are gone. Handlers that ignore it make that re-raise harmless, so a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s as %s on http://%s:%d", engine.model_path, ", ".join(names), args.host, args.port)
    server.run()
    if not server.started:  # e.g. the port is taken; uvicorn has logged why
        return 1
    logger.info("server stopped")
    return 0
