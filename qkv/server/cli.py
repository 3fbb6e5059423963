"""``qkv serve MODEL``: load the engine, then run the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal

__all__ = ["add_serve_args", "serve"]

logger = logging.getLogger("qkv.server")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ..cli import add_engine_args
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("QKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $QKV_API_KEY; /health stays open)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the MODEL argument); the first is reported")
    p.add_argument("--max-request-body", default="1MiB", help="largest accepted request body (413 beyond)")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines while busy")
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="on SIGTERM, wait this long for in-flight requests before cancelling them")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import engine_kwargs
    from ..config import EngineConfig, parse_size
    from ..engine import LLMEngine
    from .app import build_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics

    max_body = parse_size(args.max_request_body)
    names = args.served_model_name or [args.model]
    engine = LLMEngine(EngineConfig(model=args.model, **engine_kwargs(args)))
    metrics = ServerMetrics(names[0])
    async_engine = AsyncEngine(engine, metrics, log_interval=args.log_interval,
                               log_stats=not args.disable_log_stats)
    app = build_app(async_engine, names, metrics, api_key=args.api_key or None, max_body_bytes=max_body,
                    max_model_len=engine.max_model_len, model_root=str(engine.model_path))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    server = uvicorn.Server(config)
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
