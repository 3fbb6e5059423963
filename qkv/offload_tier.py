"""The offload tier's store: an LRU of entries (key -> bytes) under a size cap, over a RAM or file backend.

The tier knows nothing of blocks or models: an entry is an opaque payload under a 32-byte key
(:mod:`qkv.offload` derives both). Its index is an ``OrderedDict`` in LRU order (first = next to
evict) holding each entry's size as the backend charges it, so ``put`` and ``get`` are O(1) and
the cap is exact. A file backend's existing entries are indexed at start (oldest mtime first) and
trimmed to the cap, so a restarted server finds what the last one stored.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Protocol

__all__ = ["OffloadTier", "RamBackend", "TierBackend", "TierBusy"]

logger = logging.getLogger("qkv")


class TierBusy(Exception):
    """A backend cannot take a write now (its background writer is behind): the entry is skipped."""


class TierBackend(Protocol):
    name: str

    def write(self, key: bytes, payload: bytes) -> int: ...  # bytes charged against the cap; may raise TierBusy
    def read(self, key: bytes) -> bytes | None: ...  # None: gone or corrupt (backend warns)
    def touch(self, key: bytes) -> None: ...
    def delete(self, key: bytes) -> None: ...
    def scan(self) -> list[tuple[bytes, int]]: ...  # existing (key, size), LRU first
    def describe(self) -> dict: ...
    @property
    def pending_bytes(self) -> int: ...  # payload bytes queued, not yet written
    def flush(self, timeout: float | None) -> int: ...  # wait for queued writes; returns those left
    def close(self, timeout: float | None) -> int: ...  # flush, then stop; returns the writes dropped


class RamBackend:
    """Entries as ``bytes`` objects in this process's memory (vLLM's native CPU offload, in spirit)."""

    name = "ram"

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def write(self, key: bytes, payload: bytes) -> int:
        self.data[key] = payload
        return len(payload)

    def entry_bytes(self, payload_len: int) -> int:
        return payload_len

    def read(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def touch(self, key: bytes) -> None:
        pass

    def delete(self, key: bytes) -> None:
        self.data.pop(key, None)

    def scan(self) -> list[tuple[bytes, int]]:
        return []

    def describe(self) -> dict:
        return {"backend": self.name}

    pending_bytes = 0  # writes are done when write() returns

    def flush(self, timeout: float | None = None) -> int:
        return 0

    def close(self, timeout: float | None = None) -> int:
        return 0


class OffloadTier:
    """Bounded LRU store. Never raises on the serving path: a failed write is skipped with a warning."""

    def __init__(self, capacity_bytes: int, backend: TierBackend) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"offload tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.backend = backend
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.used = 0
        self.bytes_written = self.bytes_read = 0
        self.entries_written = self.entries_read = 0
        self.evictions = 0  # entries dropped to stay under the cap
        self.bad_entries = 0  # entries that failed to read back (corrupt, truncated, gone)
        self.write_errors = 0
        self.skipped = 0  # entries not stored because the backend was busy (TierBusy)
        for key, size in backend.scan():
            self.index[key] = size
            self.used += size
        self.found_at_start = len(self.index)
        self._make_room(0)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` as recently used (it was just evicted from the device again)."""
        if key in self.index:
            self.index.move_to_end(key)

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store ``payload`` as the most recent entry, evicting the least recent ones to fit.

        ``False`` if it was not stored: already there (the bytes of one key are interchangeable),
        larger than the whole cap, the backend busy (counted in ``skipped``) or failing (one warning).
        """
        if key in self.index:
            self.index.move_to_end(key)
            return False
        if len(payload) > self.capacity:
            return False
        try:
            size = self.backend.write(key, payload)
        except TierBusy:
            self.skipped += 1
            return False
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1:
                logger.warning(
                    "KV offload tier (%s): cannot store an entry (%s: %s); going on without it",
                    self.backend.name,
                    type(e).__name__,
                    e,
                )
            return False
        self.index[key] = size
        self.used += size
        self.bytes_written += len(payload)
        self.entries_written += 1
        self._make_room(0)  # evicts after the write, so that a busy backend costs no entry
        return key in self.index

    def get(self, key: bytes) -> bytes | None:
        """The payload, or ``None`` (a miss) if absent or unreadable; an unreadable entry is dropped."""
        if key not in self.index:
            return None
        payload = self.backend.read(key)
        if payload is None:
            self._drop(key)
            self.bad_entries += 1
            return None
        self.index.move_to_end(key)
        self.backend.touch(key)
        self.bytes_read += len(payload)
        self.entries_read += 1
        return payload

    def clear(self) -> None:
        """Delete every entry (the benchmark's cold start)."""
        for key in list(self.index):
            self._drop(key)

    def _make_room(self, incoming: int) -> None:
        while self.index and self.used + incoming > self.capacity:
            key = next(iter(self.index))
            self._drop(key)
            self.evictions += 1

    def _drop(self, key: bytes) -> None:
        self.used -= self.index.pop(key)
        with contextlib.suppress(OSError):
            self.backend.delete(key)

    def report(self) -> dict:
        return {
            **self.backend.describe(),
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "entries": len(self.index),
            "entries_found_at_start": self.found_at_start,
            "entries_written": self.entries_written,
            "entries_read": self.entries_read,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "evictions": self.evictions,
            "bad_entries": self.bad_entries,
            "write_errors": self.write_errors,
            "skipped": self.skipped,
        }
