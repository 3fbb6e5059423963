"""OpenAI-compatible HTTP server for the qkv engine (``qkv serve``).

Modules: ``protocol`` (request models, errors), ``async_engine`` (the engine
thread and its asyncio bridge), ``serving`` (completions and chat), ``metrics``
(Prometheus), ``app`` (FastAPI routes) and ``cli`` (the ``serve`` subcommand).
"""

from __future__ import annotations

__all__ = ["register"]


def register(sub) -> None:
    """Add ``qkv serve`` to the ``qkv`` command's subparsers."""
    from .cli import add_serve_args, serve

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics)")
    add_serve_args(p)
    p.set_defaults(func=serve)
