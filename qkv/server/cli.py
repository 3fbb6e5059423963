"""``qkv serve MODEL``: load the engine, then run the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass

import uvicorn

from ..config import EngineConfig, parse_size
from ..config_flags import add_config_args, add_engine_args, config_kwargs, engine_kwargs
from ..options import option, validate_options
from ..stats import LOG_INTERVAL_S

__all__ = ["add_serve_args", "serve", "GracefulServer", "ServeOptions"]

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
        self.shutdown_started: float | None = None  # time.monotonic() when the signal came

    def time_left(self) -> float:
        """What is left of ``shutdown_timeout`` since the signal (all of it if none came)."""
        if self.shutdown_started is None:
            return self.shutdown_timeout
        return max(0.0, self.shutdown_timeout - (time.monotonic() - self.shutdown_started))

    async def shutdown(self, sockets=None) -> None:
        self.shutdown_started = time.monotonic()
        cut = asyncio.ensure_future(self._cut_after_timeout())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _cut_after_timeout(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        logger.warning("--shutdown-timeout of %.1f s reached: ending the requests still running", self.shutdown_timeout)
        await self.engine.stop()


def _max_body(value: str) -> None:
    if parse_size(value) <= 0:
        raise ValueError(f"must be > 0, got {value!r}")


@dataclass
class ServeOptions:
    """``qkv serve``'s own options (the engine's are EngineConfig's), checked before the model loads."""

    host: str = option("127.0.0.1", "bind address (default: loopback only)")
    port: int = option(8000, "TCP port", ge=0)
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' (default: $QKV_API_KEY; /health stays open)"
    )
    served_model_name: list[str] | None = option(
        None, "name(s) clients use in 'model' (default: the MODEL argument); the first is reported"
    )
    max_request_body: str = option("1MiB", "largest accepted request body (413 beyond)", check=_max_body)
    log_interval: float = option(LOG_INTERVAL_S, "seconds between stats lines while busy", ge=0)
    disable_log_stats: bool = option(False, "no periodic stats lines")
    disable_uvicorn_access_log: bool = option(False, "no access log line per request")
    shutdown_timeout: float = option(
        60.0,
        "on SIGTERM, wait this long for in-flight requests, then end them with an error "
        "(streams: an SSE error event and [DONE]); a file offload tier's queued writes are flushed "
        "in what is left",
        ge=0,
    )

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("QKV_API_KEY")
        validate_options(self)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_config_args(p, ServeOptions)


def serve(args: argparse.Namespace) -> int:
    from ..engine import LLMEngine
    from .app import build_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics

    opts = ServeOptions(**config_kwargs(ServeOptions, args))
    names = opts.served_model_name or [args.model]
    engine = LLMEngine(EngineConfig(model=args.model, **engine_kwargs(args)))
    metrics = ServerMetrics(names[0])
    async_engine = AsyncEngine(engine, metrics, log_interval=opts.log_interval, log_stats=not opts.disable_log_stats)
    app = build_app(
        async_engine,
        names,
        metrics,
        api_key=opts.api_key or None,
        max_body_bytes=parse_size(opts.max_request_body),
        model_root=str(engine.model_path),
    )
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level="info",
        access_log=not opts.disable_uvicorn_access_log,
        lifespan="on",
    )
    server = GracefulServer(config, async_engine, opts.shutdown_timeout)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal it caught once its own
    # handlers are gone. Handlers that ignore it make that re-raise harmless, so a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s as %s on http://%s:%d", engine.model_path, ", ".join(names), opts.host, opts.port)
    server.run()
    _close_engine(engine, server.time_left())
    if not server.started:  # e.g. the port is taken; uvicorn has logged why
        return 1
    logger.info("server stopped")
    return 0


def _close_engine(engine, timeout: float) -> None:
    """Flush the offload tier's queued writes in what is left of --shutdown-timeout, so a restart hits them."""
    if engine.offload is None:
        return
    t0 = time.monotonic()
    queued = engine.offload.counters()["kv_offload_write_queue_bytes"]
    dropped = engine.close(timeout)
    if dropped:
        logger.warning("KV offload: %d block writes dropped: --shutdown-timeout reached", dropped)
    elif queued:
        logger.info("KV offload: %d queued bytes written in %.2f s", queued, time.monotonic() - t0)
