"""The offload tier's store on its own: LRU under a byte cap, the file format, restarts, and bad entries.

No model: entries are opaque payloads under 32-byte keys, so every size and order is exact.
"""

import hashlib
import logging
import os

import pytest

from qkv.offload_files import FILE_FORMAT_VERSION, HEADER, MAGIC, SUFFIX, FileBackend
from qkv.offload_tier import OffloadTier, RamBackend

PAYLOAD = bytes(range(256)) * 4  # 1,024 bytes


def key(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def entry(i: int) -> bytes:
    return bytes([i]) * 1024


def test_ram_tier_is_an_lru_under_its_cap():
    tier = OffloadTier(3 * 1024, RamBackend())
    assert [tier.put(key(i), entry(i)) for i in range(3)] == [True] * 3
    assert tier.get(key(0)) == entry(0)  # 0 becomes the most recent
    assert tier.put(key(3), entry(3))  # evicts 1, the least recent
    assert list(tier.index) == [key(2), key(0), key(3)] and key(1) not in tier.backend.data
    assert (tier.used, tier.evictions, len(tier)) == (3 * 1024, 1, 3)
    assert not tier.put(key(2), b"other bytes")  # already stored: kept as it is, but now the most recent
    assert list(tier.index) == [key(0), key(3), key(2)] and tier.get(key(2)) == entry(2)
    assert not tier.put(key(9), bytes(3 * 1024 + 1))  # larger than the whole tier
    assert tier.get(key(1)) is None
    r = tier.report()
    assert (r["entries_written"], r["bytes_written"], r["entries_read"], r["bytes_read"]) == (4, 4096, 2, 2048)
    tier.clear()
    assert (len(tier), tier.used, tier.backend.data) == (0, 0, {})


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be > 0 bytes, got 0"):
        OffloadTier(0, RamBackend())


def test_file_entry_format(tmp_path):
    fb = FileBackend(tmp_path / "tier")  # created if missing
    assert fb.write(key(1), PAYLOAD) == HEADER.size + 1024 == 84 + 1024
    assert os.listdir(tmp_path / "tier") == [key(1).hex() + SUFFIX]  # no temporary file left behind
    data = (tmp_path / "tier" / (key(1).hex() + ".kvblock")).read_bytes()
    assert data[:8] == MAGIC == b"QKVKVBLK"
    assert int.from_bytes(data[8:12], "big") == FILE_FORMAT_VERSION == 1
    assert data[12:44] == key(1) and int.from_bytes(data[44:52], "big") == 1024
    assert data[52:84] == hashlib.sha256(PAYLOAD).digest() and data[84:] == PAYLOAD
    assert fb.read(key(1)) == PAYLOAD


def test_file_tier_survives_a_restart_in_lru_order(tmp_path):
    tier = OffloadTier(10 * 1108, FileBackend(tmp_path))
    for i in range(3):
        tier.put(key(i), entry(i))
    for i, t in ((0, 3), (1, 1), (2, 2)):  # mtimes say: 1 is the least recently used, then 2, then 0
        os.utime(tmp_path / (key(i).hex() + SUFFIX), ns=(t * 10**9, t * 10**9))
    (tmp_path / f".{key(7).hex()}.123.tmp").write_bytes(b"half a file")  # a crash left it
    (tmp_path / "notes.txt").write_text("not ours")
    again = OffloadTier(10 * 1108, FileBackend(tmp_path))
    assert list(again.index) == [key(1), key(2), key(0)] and again.found_at_start == 3
    assert again.used == 3 * (84 + 1024) and again.get(key(2)) == entry(2)
    assert sorted(os.listdir(tmp_path)) == sorted([key(i).hex() + SUFFIX for i in range(3)] + ["notes.txt"])
    # a smaller cap at start drops the least recently used files
    small = OffloadTier(2 * 1108, FileBackend(tmp_path))
    assert list(small.index) == [key(0), key(2)] and not (tmp_path / (key(1).hex() + SUFFIX)).exists()
    assert small.evictions == 1


def _flip_payload(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


DAMAGE = {
    "flipped payload byte": (_flip_payload, "corrupt (payload checksum mismatch)"),
    "truncated payload": (lambda d: d[:-100], "truncated or padded (924 payload bytes, header says 1024)"),
    "truncated header": (lambda d: d[:10], "truncated (10 bytes, shorter than the 84-byte header)"),
    "wrong magic": (lambda d: b"NOTQKV!!" + d[8:], "not a qkv KV block file (magic b'NOTQKV!!')"),
    "other version": (lambda d: d[:8] + (9).to_bytes(4, "big") + d[12:], "format version 9, not 1"),
    "other key": (lambda d: d[:12] + key(5) + d[44:], "holding another key than its name says"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_bad_file_is_a_miss_with_one_warning_naming_it(tmp_path, caplog, damage):
    tier = OffloadTier(10 * 1108, FileBackend(tmp_path))
    tier.put(key(1), PAYLOAD)
    tier.put(key(2), entry(2))
    path = tmp_path / (key(1).hex() + SUFFIX)
    fn, why = DAMAGE[damage]
    path.write_bytes(fn(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="qkv"):
        assert tier.get(key(1)) is None
        assert tier.get(key(1)) is None  # dropped: the second look is a plain miss
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"KV offload entry {path} is {why}: dropped; its blocks will be recomputed"]
    assert not path.exists() and key(1) not in tier and tier.bad_entries == 1
    assert tier.used == 84 + 1024 and tier.get(key(2)) == entry(2)  # the other entry is untouched


def test_a_vanished_file_is_a_miss(tmp_path, caplog):
    tier = OffloadTier(10 * 1108, FileBackend(tmp_path))
    tier.put(key(1), PAYLOAD)
    (tmp_path / (key(1).hex() + SUFFIX)).unlink()
    with caplog.at_level(logging.WARNING, logger="qkv"):
        assert tier.get(key(1)) is None
    assert len(caplog.records) == 1 and "unreadable (FileNotFoundError" in caplog.records[0].getMessage()
    assert (len(tier), tier.used, tier.bad_entries) == (0, 0, 1)


def test_a_failing_write_is_skipped_with_one_warning(tmp_path, caplog, monkeypatch):
    backend = FileBackend(tmp_path)

    def full(key, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(backend, "write", full)
    tier = OffloadTier(10 * 1108, backend)
    with caplog.at_level(logging.WARNING, logger="qkv"):
        assert not tier.put(key(1), PAYLOAD) and not tier.put(key(2), PAYLOAD)
    assert [r.getMessage() for r in caplog.records] == [
        "KV offload tier (file): cannot store an entry (OSError: [Errno 28] No space left on device); "
        "going on without it"
    ]
    assert (len(tier), tier.used, tier.write_errors) == (0, 0, 2)
