"""Drive a (not thread-safe) :class:`LLMEngine` from one thread and serve it to asyncio.

The engine thread owns the engine. It sleeps on a command queue while idle and,
while there is work, alternates: apply every queued command (add, abort, call),
then ``step()``. Each step's outputs are handed to the asyncio loop in one
``call_soon_threadsafe``, one :class:`asyncio.Queue` per request, or one shared
by the requests of a batch of prompts. So requests that arrive while others
decode join the very next step (continuous batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..sampling import SamplingParams
from ..sequence import RequestOutput
from ..stats import LOG_INTERVAL_S, StatsLogger
from .metrics import ServerMetrics, snapshot_engine

__all__ = ["AsyncEngine", "EngineDeadError"]

logger = logging.getLogger("qkv.server")

Prompt = str | list[int] | Callable[[Any], list[int]]  # a callable is run on the engine thread


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    queue: asyncio.Queue
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass
class _Cmd:
    kind: str  # "add" | "abort" | "call" | "stop"
    request_id: str | None = None
    args: tuple = ()
    future: asyncio.Future | None = None


class AsyncEngine:
    def __init__(
        self, engine, metrics: ServerMetrics | None = None, log_interval: float = LOG_INTERVAL_S, log_stats: bool = True
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_interval = log_interval
        self.log_stats = log_stats
        self.snapshot: dict = {}
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        if metrics is not None:
            metrics.watch(lambda: self.snapshot)

    # -- lifecycle (asyncio side) ------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.snapshot = snapshot_engine(self.engine)
        self._thread = threading.Thread(target=self._run, name="qkv-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, then end the engine thread.

        Every request still running gets ``EngineDeadError("the server is shutting down")``: a stream
        ends with an error event and ``[DONE]``, a plain request with a 503.
        """
        if self._thread is None:
            return
        self._cmds.put(_Cmd("stop"))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- requests (asyncio side) -------------------------------------------------
    async def add(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        queue: asyncio.Queue | None = None,
        **options,
    ) -> asyncio.Queue:
        """Queue a request; raises the engine's ``ValueError`` if it rejects it.

        ``queue`` receives its outputs (a new one if None; pass one queue for
        several requests to read them together with :meth:`outputs`).
        ``options`` go to ``LLMEngine.add_request`` (``cache_salt``, ``strict_max_tokens``).
        """
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        fut = self._loop.create_future()
        out: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        args = (prompt, params, arrival_time or time.monotonic(), out, options)
        self._cmds.put(_Cmd("add", request_id, args, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # processed after the add: nothing leaks
            raise
        return out

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; unknown or finished ids are ignored."""
        self._cmds.put(_Cmd("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        fut = self._loop.create_future()
        self._cmds.put(_Cmd("call", None, (fn,), fut))
        return await fut

    async def outputs(self, request_ids: str | list[str], q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of requests added with queue ``q`` until all finish; leaving early aborts
        the unfinished ones (frees their blocks)."""
        pending = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        try:
            while pending:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            for rid in pending:
                self.abort(rid)

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """``add`` then ``outputs``: the whole request as one async iterator."""
        q = await self.add(request_id, prompt, params, arrival_time)
        async with contextlib.aclosing(self.outputs(request_id, q)) as outs:
            async for out in outs:
                yield out

    # -- the engine thread -------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        stats_logger = None
        try:
            while True:
                busy = engine.has_unfinished_requests()
                self._apply_commands(block=not busy)
                if self._stopping:
                    break
                if not engine.has_unfinished_requests():
                    self.snapshot = snapshot_engine(engine)
                    if stats_logger is not None:  # busy -> idle: log the tail of the busy period
                        stats_logger.maybe_log(self._fresh_stats(), force=True)
                        stats_logger = None
                    continue
                if stats_logger is None and self.log_stats:
                    stats_logger = self._fresh_stats_logger()
                outputs = engine.step()
                self._deliver(outputs)
                self.snapshot = snapshot_engine(engine)
                if stats_logger is not None:
                    stats_logger.maybe_log(self._fresh_stats())
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("engine loop failed")
            self.error = e
            self._fail_all(EngineDeadError(f"engine loop failed: {e!r}"))
            return
        self._shutdown()

    def _fresh_stats(self):
        """``engine.stats`` with gauges read now (an abort between steps leaves its gauges stale)."""
        snap = self.snapshot
        return dataclasses.replace(
            self.engine.stats,
            num_running=snap["num_requests_running"],
            num_waiting=snap["num_requests_waiting"],
            kv_usage=snap["kv_cache_usage_perc"],
        )

    def _fresh_stats_logger(self) -> StatsLogger:
        """A logger whose throughput window starts now, not at the end of the last busy period."""
        sl = StatsLogger(self.log_interval, lambda line: None)
        sl.maybe_log(self.engine.stats, force=True)
        sl.log = logger.info
        return sl

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get() if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: _Cmd) -> None:
        engine = self.engine
        if cmd.kind == "add":
            prompt, params, arrival, out, options = cmd.args
            try:
                if callable(prompt):
                    prompt = prompt(engine)
                engine.add_request(prompt, params, request_id=cmd.request_id, arrival_time=arrival, **options)
            except Exception as e:  # noqa: BLE001 - ValueError is the client's; others go back too
                self._resolve(cmd.future, exc=e)
                return
            self._streams[cmd.request_id] = _Stream(out)
            self._resolve(cmd.future, None)
        elif cmd.kind == "abort":
            stream = self._streams.pop(cmd.request_id, None)
            if engine.abort_request(cmd.request_id) and self.metrics is not None:
                self.metrics.finished("abort")
            if stream is not None:
                logger.info("request %s aborted", cmd.request_id)
            self.snapshot = snapshot_engine(engine)
        elif cmd.kind == "call":
            try:
                self._resolve(cmd.future, cmd.args[0](engine))
            except Exception as e:  # noqa: BLE001
                self._resolve(cmd.future, exc=e)
        elif cmd.kind == "stop":
            self._stopping = True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch = []
        m = self.metrics
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            n = max(len(c.token_ids) for c in out.outputs)  # samples advance together: one token each per step
            if m is not None and n > stream.num_tokens:
                if stream.last_token_time is None:
                    if out.metrics.ttft is not None:
                        m.ttft.observe(out.metrics.ttft)
                else:
                    # One step may add more than one token only after preemption; spread the gap.
                    gap = (now - stream.last_token_time) / (n - stream.num_tokens)
                    for _ in range(n - stream.num_tokens):
                        m.itl.observe(gap)
                stream.last_token_time = now
            stream.num_tokens = n
            if out.finished:
                del self._streams[out.request_id]
                if m is not None:
                    m.e2e.observe(now - out.metrics.arrival_time)
                    m.finished(out.outputs[0].finish_reason or "stop")
            batch.append((stream.queue, out))
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _resolve(self, fut: asyncio.Future | None, value: Any = None, exc: BaseException | None = None) -> None:
        if fut is not None:
            self._loop.call_soon_threadsafe(_settle, fut, value, exc)

    def _fail_all(self, exc: BaseException) -> None:
        batch = [(s.queue, exc) for s in self._streams.values()]
        self._streams.clear()
        with contextlib.suppress(RuntimeError):  # loop already closed
            if batch:
                self._loop.call_soon_threadsafe(_put_all, batch)
        while True:  # settle pending add/call futures too
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            with contextlib.suppress(RuntimeError):
                self._resolve(cmd.future, exc=exc)

    def _shutdown(self) -> None:
        """Stop requested: abort what is left (a drained server has nothing left)."""
        engine = self.engine
        for rid in list(self._streams):
            engine.abort_request(rid)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self.snapshot = snapshot_engine(engine)


def _put_all(batch) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
