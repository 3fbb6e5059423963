"""A tier backend whose writes happen on a background thread: the engine step never waits for a disk.

The write-through tier (:mod:`qkv.offload`) stores every block once it is computed. Hashing and writing
a file per block on the engine thread would add the disk's latency to every step, so the file backend
is wrapped in :class:`BackgroundWriter`: ``write`` and ``delete`` append to one ordered queue that a
single thread drains. The queue is bounded in payload bytes. When the thread is behind, ``write``
raises :class:`~qkv.offload_tier.TierBusy` and the tier skips (and counts) the block instead of
queueing without bound: a skipped block costs a recomputation on some later miss, an unbounded queue
costs memory nobody budgeted.

Reads stay consistent while writes are in flight. A payload stays in ``_pending`` until its file has
been renamed into place, and ``read`` serves it from there, so a block that is stored but not yet on
disk is still a hit. Operations on one key run in the order they were queued (a write, then the
delete of the tier's LRU eviction), so a deleted entry never reappears on disk.

A crash loses what was queued, never correctness: the file backend writes a temporary name and
renames it, and every read checks the header and checksum. A clean stop drains the queue
(:meth:`close`, within the server's ``--shutdown-timeout``), and so does interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
import time

from .offload_tier import TierBusy

__all__ = ["BackgroundWriter", "WRITE_QUEUE_BYTES"]

logger = logging.getLogger("qkv")

# Payload bytes the writer may hold. A 2,048-token prefill of a 30-layer model with an fp8 cache makes
# ~50 MB of blocks in one step; a few such steps of slack keep a busy disk from skipping blocks.
WRITE_QUEUE_BYTES = 256 << 20


class BackgroundWriter:
    """Wraps a backend (``write`` / ``read`` / ``touch`` / ``delete``) so that writes and deletes run on a thread."""

    def __init__(self, backend, max_pending_bytes: int = WRITE_QUEUE_BYTES) -> None:
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be > 0, got {max_pending_bytes}")
        self.backend = backend
        self.name = backend.name
        self.max_pending_bytes = max_pending_bytes
        self._ops: collections.deque[tuple[str, bytes, bytes | None]] = collections.deque()
        self._pending: dict[bytes, bytes] = {}  # key -> payload queued or being written, not yet on disk
        self._pending_bytes = 0  # payload bytes of the write operations not yet done
        self._busy = False  # the thread holds an operation taken off the queue
        self._closed = False
        self._cv = threading.Condition()
        self.written = 0  # files the thread completed
        self.failed = 0  # writes the backend refused (the entry then reads as missing: a miss)
        self._thread = threading.Thread(target=self._run, name="qkv-offload-writer", daemon=True)
        self._thread.start()
        atexit.register(self._drain_at_exit)

    # -- the tier's side (engine thread) ----------------------------------------------------------
    def entry_bytes(self, payload_len: int) -> int:
        return self.backend.entry_bytes(payload_len)

    def write(self, key: bytes, payload: bytes) -> int:
        """Queue ``payload`` under ``key``; raises :class:`TierBusy` when the queue is full or closed."""
        with self._cv:
            if self._closed:
                raise TierBusy("the offload writer is closed")
            if self._pending_bytes + len(payload) > self.max_pending_bytes and self._pending_bytes > 0:
                raise TierBusy(f"{self._pending_bytes} payload bytes already queued")
            self._ops.append(("write", key, payload))
            self._pending[key] = payload
            self._pending_bytes += len(payload)
            self._cv.notify()
        return self.backend.entry_bytes(len(payload))

    def read(self, key: bytes) -> bytes | None:
        with self._cv:
            payload = self._pending.get(key)
        return payload if payload is not None else self.backend.read(key)

    def touch(self, key: bytes) -> None:
        with self._cv:
            if key in self._pending:  # not on disk yet: its file's mtime will be new anyway
                return
        self.backend.touch(key)

    def delete(self, key: bytes) -> None:
        with self._cv:
            if self._closed:
                return
            self._pending.pop(key, None)
            self._ops.append(("delete", key, None))
            self._cv.notify()

    def scan(self) -> list[tuple[bytes, int]]:
        return self.backend.scan()

    def describe(self) -> dict:
        with self._cv:
            queued = sum(1 for op in self._ops if op[0] == "write")
        return {
            **self.backend.describe(),
            "writer_queued_writes": queued,
            "writer_queued_bytes": self._pending_bytes,
            "writer_max_queued_bytes": self.max_pending_bytes,
            "writer_files_written": self.written,
            "writer_failed_writes": self.failed,
        }

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued operation is done, at most ``timeout`` seconds; returns the writes left."""
        with self._cv:
            self._cv.wait_for(lambda: not self._ops and not self._busy, timeout)
            return sum(1 for op in self._ops if op[0] == "write")

    def close(self, timeout: float | None = None) -> int:
        """Flush within ``timeout``, then stop the thread; returns the writes dropped (never on disk)."""
        left = self.flush(timeout)
        with self._cv:
            self._closed = True
            dropped = sum(1 for op in self._ops if op[0] == "write")
            self._ops.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self._cv.notify_all()
        self._thread.join(timeout=5.0)
        atexit.unregister(self._drain_at_exit)
        if dropped:
            logger.warning("KV offload: %d queued block writes dropped at close (not on disk)", dropped)
        return max(left, dropped)

    def _drain_at_exit(self) -> None:
        """An offline ``LLM`` has no shutdown hook: finish the queue before the interpreter ends."""
        with contextlib.suppress(Exception):
            t0 = time.monotonic()
            n = self.close(timeout=60.0)
            if time.monotonic() - t0 > 1.0 or n:
                logger.info("KV offload: writer drained at exit (%d writes dropped)", n)

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._ops or self._closed)
                if self._closed:
                    return
                op, key, payload = self._ops.popleft()
                self._busy = True
            try:
                if op == "write":
                    assert payload is not None  # write ops carry their payload
                    self._write(key, payload)
                else:
                    with contextlib.suppress(OSError):
                        self.backend.delete(key)
            finally:
                with self._cv:
                    if op == "write" and payload is not None:
                        self._pending_bytes -= len(payload)
                        if self._pending.get(key) is payload:
                            del self._pending[key]
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, key: bytes, payload: bytes) -> None:
        try:
            self.backend.write(key, payload)
            self.written += 1
        except Exception as e:  # noqa: BLE001 - the thread must outlive a full disk
            self.failed += 1
            if self.failed == 1:
                logger.warning(
                    "KV offload tier (%s): cannot store an entry (%s: %s); going on without it",
                    self.name,
                    type(e).__name__,
                    e,
                )
