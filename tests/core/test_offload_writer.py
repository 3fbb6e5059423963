"""The file tier's background writer: ordered, bounded, readable while in flight, drained on close.

A real :class:`FileBackend` on a temporary directory does the writing; a gate in front of it holds
the writer thread still, so that "behind" is a state the test sets, not a race it hopes for.
"""

import threading

import pytest

from qkv.offload_files import HEADER, SUFFIX, FileBackend, check_entry
from qkv.offload_tier import OffloadTier, TierBusy
from qkv.offload_writer import BackgroundWriter


def key(i: int) -> bytes:
    return bytes([i]) * 32


def entry(i: int) -> bytes:
    return bytes([i % 251]) * 1000


class GatedFiles(FileBackend):
    """A file backend whose writes wait until the test opens the gate (and say when one started)."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.gate, self.started = threading.Event(), threading.Event()

    def write(self, key: bytes, payload: bytes) -> int:
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().write(key, payload)


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_writes_land_in_order_and_read_back_while_queued(tmp_path):
    backend = GatedFiles(tmp_path)
    writer = BackgroundWriter(backend, max_pending_bytes=10_000)
    tier = OffloadTier(10 * (HEADER.size + 1000), writer)
    for i in range(3):
        assert tier.put(key(i), entry(i))
    assert backend.started.wait(30)  # the thread holds the first write at the gate
    assert files(tmp_path) == []  # nothing is on disk yet, and still every entry reads back
    assert [tier.get(key(i)) for i in range(3)] == [entry(i) for i in range(3)]
    assert writer.pending_bytes == 3000 and tier.used == 3 * (HEADER.size + 1000)
    tier._drop(key(1))  # the tier's eviction: a delete queued behind the write of the same key
    backend.gate.set()
    assert writer.flush(30) == 0 and writer.pending_bytes == 0
    assert files(tmp_path) == sorted(key(i).hex() + SUFFIX for i in (0, 2))  # 1 was written, then deleted
    for i in (0, 2):
        data = (tmp_path / (key(i).hex() + SUFFIX)).read_bytes()
        assert check_entry(data, key(i)) is None and data[HEADER.size :] == entry(i)
    assert (writer.written, writer.failed) == (3, 0)
    assert writer.close(5) == 0


def test_a_full_queue_skips_and_counts_instead_of_growing(tmp_path):
    backend = GatedFiles(tmp_path)
    writer = BackgroundWriter(backend, max_pending_bytes=2000)  # room for two 1,000-byte payloads
    tier = OffloadTier(10 * (HEADER.size + 1000), writer)
    assert tier.put(key(0), entry(0)) and tier.put(key(1), entry(1))
    assert not tier.put(key(2), entry(2))  # behind: skipped, not queued
    assert (tier.skipped, len(tier), key(2) in tier, writer.pending_bytes) == (1, 2, False, 2000)
    backend.gate.set()
    assert writer.flush(30) == 0
    assert tier.put(key(2), entry(2))  # room again
    assert writer.flush(30) == 0
    assert files(tmp_path) == sorted(key(i).hex() + SUFFIX for i in range(3))
    writer.close(5)


def test_close_drains_the_queue_or_reports_what_it_dropped(tmp_path):
    drained = BackgroundWriter(FileBackend(tmp_path / "a"))
    for i in range(20):
        drained.write(key(i), entry(i))
    assert drained.close(30) == 0 and len(files(tmp_path / "a")) == 20
    with pytest.raises(TierBusy, match="closed"):
        drained.write(key(99), entry(99))

    backend = GatedFiles(tmp_path / "b")
    stuck = BackgroundWriter(backend)
    for i in range(5):
        stuck.write(key(i), entry(i))
    assert backend.started.wait(30)
    threading.Timer(0.5, backend.gate.set).start()  # after close has given up waiting
    assert stuck.close(0.2) == 4  # the one at the gate is being written; the other four are dropped
    assert files(tmp_path / "b") == [key(0).hex() + SUFFIX]


def test_a_failing_write_is_counted_and_reads_as_a_miss(tmp_path, caplog):
    target = tmp_path / "tier"
    writer = BackgroundWriter(FileBackend(target))
    tier = OffloadTier(1 << 20, writer)
    target.rmdir()  # the directory vanished under a running server
    assert tier.put(key(0), entry(0))
    assert writer.flush(30) == 0 and (writer.written, writer.failed) == (0, 1)
    assert tier.get(key(0)) is None and tier.bad_entries == 1  # a miss, never wrong bytes
    assert [r.getMessage().split(" (FileNotFoundError")[0] for r in caplog.records if r.levelname == "WARNING"] == [
        "KV offload tier (file): cannot store an entry",
        f"KV offload entry {target / (key(0).hex() + SUFFIX)} is unreadable",
    ]
    writer.close(5)
