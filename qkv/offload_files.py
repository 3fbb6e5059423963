"""The file backend of the offload tier: one file per KV block under ``--kv-offloading-dir``.

Files are what lets the tier survive a restart, so the format is explicit and checked:

* name: ``<key hex>.kvblock`` (the key is a 32-byte SHA-256, see :mod:`qkv.offload`);
* header (:data:`HEADER`, 84 bytes, big-endian): magic ``QKVKVBLK``, format version, the key again,
  payload length, SHA-256 of the payload;
* payload: the block's bytes, every layer's K/V rows then its dynamic scales, in cache order.

A file is written to a temporary name in the same directory and renamed over its final name,
so a reader never sees half a file under a key name (a crash leaves only a ``.tmp`` file, which
the next start deletes). Nothing is fsynced: a file that lost its tail in a power failure fails
its length or checksum test when read, and a failed test is a miss, never wrong bytes. Starting
only lists the directory (names, sizes, mtimes); the checks run when an entry is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from pathlib import Path

__all__ = ["FileBackend", "HEADER", "MAGIC", "FILE_FORMAT_VERSION", "SUFFIX"]

logger = logging.getLogger("qkv")

MAGIC = b"QKVKVBLK"
FILE_FORMAT_VERSION = 1
HEADER = struct.Struct(">8sI32sQ32s")  # magic, version, key, payload length, sha256(payload)
SUFFIX = ".kvblock"
_KEY_HEX = 64


class FileBackend:
    """Entries as files in one directory; the LRU order and the size cap live in :class:`OffloadTier`."""

    name = "file"

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def write(self, key: bytes, payload: bytes) -> int:
        """Store ``payload`` under ``key`` atomically; returns the bytes it occupies (header included)."""
        header = HEADER.pack(MAGIC, FILE_FORMAT_VERSION, key, len(payload), hashlib.sha256(payload).digest())
        tmp = self.dir / f".{key.hex()}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self.entry_bytes(len(payload))

    @staticmethod
    def entry_bytes(payload_len: int) -> int:
        """What an entry occupies against the tier's cap: the header and the payload."""
        return HEADER.size + payload_len

    def read(self, key: bytes) -> bytes | None:
        """The payload, or ``None`` after one warning naming the file if it is missing, truncated or corrupt.

        A bad file is deleted, so it is reported once and its blocks are recomputed (and stored again
        when they are next evicted).
        """
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as e:
            return self._bad(path, f"unreadable ({type(e).__name__}: {e})")
        problem = check_entry(data, key)
        if problem:
            return self._bad(path, problem)
        return data[HEADER.size :]

    def touch(self, key: bytes) -> None:
        """Mark a hit in the file's mtime, so that the LRU order survives a restart."""
        with contextlib.suppress(OSError):  # gone: the next read reports it
            os.utime(self.path(key))

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def scan(self) -> list[tuple[bytes, int]]:
        """Entries already in the directory as (key, size), least recently used first (by mtime).

        Temporary files left by a crash are deleted; files whose name is not a key are not ours and
        are left alone.
        """
        found = []
        for path in self.dir.iterdir():
            name = path.name
            if name.startswith(".") and name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
            if len(stem) != _KEY_HEX:
                continue
            try:
                key, st = bytes.fromhex(stem), path.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime_ns, name, key, st.st_size))
        found.sort()
        return [(key, size) for _, _, key, size in found]

    def describe(self) -> dict:
        return {"backend": self.name, "dir": str(self.dir)}

    pending_bytes = 0  # on its own it writes synchronously; qkv.offload_writer puts a thread in front

    def flush(self, timeout: float | None = None) -> int:
        return 0

    def close(self, timeout: float | None = None) -> int:
        return 0

    @staticmethod
    def _bad(path: Path, why: str) -> None:
        logger.warning("KV offload entry %s is %s: dropped; its blocks will be recomputed", path, why)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None


def check_entry(data: bytes, key: bytes) -> str | None:
    """Why ``data`` (a whole file) is not a valid entry for ``key``, or ``None`` if it is."""
    if len(data) < HEADER.size:
        return f"truncated ({len(data)} bytes, shorter than the {HEADER.size}-byte header)"
    magic, version, stored_key, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        return f"not a qkv KV block file (magic {magic!r})"
    if version != FILE_FORMAT_VERSION:
        return f"format version {version}, not {FILE_FORMAT_VERSION}"
    if stored_key != key:
        return "holding another key than its name says"
    if len(data) - HEADER.size != length:
        return f"truncated or padded ({len(data) - HEADER.size} payload bytes, header says {length})"
    if hashlib.sha256(memoryview(data)[HEADER.size :]).digest() != digest:
        return "corrupt (payload checksum mismatch)"
    return None
