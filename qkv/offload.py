"""A second tier for prefix-cache blocks: every computed block is stored in RAM or files, and comes back on a hit.

vLLM's native CPU offload and LMCache keep KV blocks in a larger, slower store than the GPU pool;
qkv does the same with its 8-bit blocks (``--kv-offloading-size GiB``, optionally backed by files
under ``--kv-offloading-dir`` so that the tier survives restarts):

* **Write-through.** ``KVCacheManager.cache_blocks`` publishes each block whose tokens are all
  computed and notes it here (:meth:`KVOffload.on_computed`); at the end of the step
  :meth:`KVOffload.write_through` gathers the noted blocks that the tier lacks with one
  ``index_select`` per layer tensor and puts one entry per block (:mod:`qkv.offload_tier`). A file
  tier writes on a background thread with a bounded queue (:mod:`qkv.offload_writer`): the step
  never waits for the disk, and a block the writer has no room for is skipped and counted. Storing
  at compute time, not at eviction, is what makes a restart or a crash lose little: the tier holds
  every finished prompt, whether or not the device pool ever had to evict it.
* **Eviction copies nothing.** ``BlockPool.get_new_blocks`` reports the cached blocks it evicts
  (:meth:`KVOffload.on_evict`); their entries only move to the recent end of the tier's LRU.
* **Load on a device miss.** ``KVCacheManager.get_computed_blocks`` walks a request's block hashes
  in the device pool; at the first miss it hands the walk to :meth:`KVOffload.extend_hits`, which
  continues along the same chain (device first, then the tier), reads the tier entries, copies
  them into fresh device blocks (one ``index_copy_`` per layer tensor) and publishes those under
  the same hashes. Afterwards the state is exactly as if a finished request had computed and
  freed them: free, cached blocks the scheduler then references as ordinary prefix hits.
* **The key** is ``sha256(namespace || block hash)`` (:mod:`qkv.offload_entry`).

With no ``--kv-offloading-size`` none of this is built: the manager's and the pool's hooks are
``None`` and cost one ``is None`` test each.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch

from .block_pool import BlockHash, BlockPool, KVBlock
from .kv_cache import KVCache
from .offload_entry import ENTRY_FORMAT_VERSION, CacheBlockIO, namespace_digest
from .offload_files import FileBackend
from .offload_tier import OffloadTier, RamBackend
from .offload_writer import BackgroundWriter
from .sequence import Sequence

__all__ = [
    "KVOffload",
    "CacheBlockIO",
    "namespace_digest",
    "build_offload",
    "evict_free_blocks",
    "OFFLOAD_COUNTERS",
    "OFFLOAD_GAUGES",
    "ENTRY_FORMAT_VERSION",
    "OFFLOADING_BACKENDS",
]

logger = logging.getLogger("qkv")

OFFLOADING_BACKENDS = ("native",)  # vLLM also has "lmcache"; qkv does not implement it

# Counters for /metrics (qkv.server.metrics), named after vLLM's connector families where they exist.
OFFLOAD_COUNTERS = {
    "external_prefix_cache_queries": "Prompt tokens of admitted requests looked up with the offload tier on.",
    "external_prefix_cache_hits": "Prompt tokens of admitted requests whose KV came from the offload tier.",
    "kv_offload_stored_blocks": "Computed blocks stored in the offload tier (write-through).",
    "kv_offload_skipped_blocks": "Computed blocks not stored because the tier's background writer was behind.",
    "kv_offload_loaded_blocks": "Blocks loaded from the offload tier into the device pool.",
    "kv_offload_bytes_written": "Payload bytes written to the offload tier.",
    "kv_offload_bytes_read": "Payload bytes read back from the offload tier.",
    "kv_offload_store_seconds": "Seconds the engine thread spent copying computed blocks out for the tier.",
    "kv_offload_load_seconds": "Seconds spent loading blocks from the offload tier (part of those requests' TTFT).",
    "kv_offload_bad_entries": "Offload entries that failed their checks (corrupt, truncated) and were recomputed.",
}
OFFLOAD_GAUGES = {
    "kv_offload_used_bytes": "Bytes held by the offload tier (its cap is --kv-offloading-size).",
    "kv_offload_entries": "Blocks held by the offload tier.",
    "kv_offload_write_queue_bytes": "Payload bytes queued for the file tier's background writer.",
}


class KVOffload:
    """Connects the device pool to the tier: stores computed blocks, loads tier hits, counts both."""

    def __init__(self, tier: OffloadTier, io, namespace: bytes, block_size: int) -> None:
        self.tier, self.io, self.namespace, self.block_size = tier, io, namespace, block_size
        self.stored_blocks = self.loaded_blocks = 0
        self.store_seconds = self.load_seconds = 0.0
        self.query_tokens = self.hit_tokens = 0
        self.store_errors = 0
        self._loaded: dict[int, BlockHash] = {}  # device blocks loaded from the tier, not yet credited
        self._computed: dict[BlockHash, int] = {}  # blocks published this step, not yet stored: hash -> id

    def key(self, block_hash: BlockHash) -> bytes:
        return hashlib.sha256(self.namespace + block_hash).digest()

    # -- device -> tier ---------------------------------------------------------------------------
    def on_computed(self, block: KVBlock, block_hash: BlockHash) -> None:
        """``KVCacheManager``'s hook: ``block`` was just published under ``block_hash``; store it this step."""
        self._computed.setdefault(block_hash, block.block_id)  # two sequences may compute one hash at once

    def write_through(self) -> None:
        """Store the blocks computed since the last call that the tier lacks (the engine calls it after each step).

        The device bytes are copied out here, on the engine thread, while no block can be reused;
        hashing and writing them is the tier's business (a file tier's thread). Nothing here raises:
        the serving path must not fail because the tier did.
        """
        if not self._computed:
            return
        t0 = time.perf_counter()
        todo: list[tuple[int, bytes]] = []
        for block_hash, block_id in self._computed.items():
            key = self.key(block_hash)
            if key in self.tier:
                self.tier.touch(key)
            else:
                todo.append((block_id, key))
        self._computed.clear()
        if not todo:
            return
        try:
            for (_, key), payload in zip(todo, self.io.gather([b for b, _ in todo])):
                self.stored_blocks += self.tier.put(key, payload)
        except Exception as e:  # noqa: BLE001
            self.store_errors += 1
            if self.store_errors == 1:
                logger.warning(
                    "KV offload: storing computed blocks failed (%s: %s); going on without them", type(e).__name__, e
                )
        self.store_seconds += time.perf_counter() - t0

    def on_evict(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """``BlockPool``'s hook: the cached blocks one allocation just evicted, bytes still intact.

        Their bytes went to the tier when they were computed; an eviction only marks their entries
        recently used. A block computed in this very step is stored first, while its bytes last.
        """
        if self._computed:
            self.write_through()
        for block_id, block_hash in evicted:
            self._loaded.pop(block_id, None)
            self.tier.touch(self.key(block_hash))

    # -- tier -> device ---------------------------------------------------------------------------
    def extend_hits(self, pool: BlockPool, hashes: list[BlockHash], hits: list[KVBlock]) -> list[KVBlock]:
        """Continue a prefix walk that missed the device at ``hashes[len(hits)]``; returns all hits.

        Along the chain each block is a device hit or else a tier hit, until both miss. Tier
        entries are read first, and the walk ends before the first one that fails its checks.
        The tier hits get fresh device blocks, at most as many as are free once the walk's device
        hits are protected from eviction. No reference is left behind.
        """
        plan: list[KVBlock | bytes] = []  # device blocks and tier keys, in chain order
        for block_hash in hashes[len(hits) :]:
            entry: KVBlock | bytes | None = pool.get_cached_block(block_hash)
            if entry is None:
                entry = self.key(block_hash)
                if entry not in self.tier:
                    break
            plan.append(entry)
        if not plan:
            return hits
        t0 = time.perf_counter()
        payloads: list[bytes] = []
        for i, item in enumerate(plan):
            if isinstance(item, bytes):
                payload = self.tier.get(item)
                if payload is None or len(payload) != self.io.block_bytes:
                    plan = plan[:i]
                    break
                payloads.append(payload)
        device = hits + [b for b in plan if isinstance(b, KVBlock)]
        pool.touch(device)  # a fresh allocation must not evict the hits it extends
        try:
            n = min(len(payloads), pool.num_free_blocks)
            if n < len(payloads):  # cut the plan before the first tier hit that gets no block
                tier_positions = [i for i, item in enumerate(plan) if isinstance(item, bytes)]
                plan, payloads = plan[: tier_positions[n]], payloads[:n]
            fresh = pool.get_new_blocks(n)
            try:
                if fresh:
                    self.io.scatter([b.block_id for b in fresh], payloads)
            except Exception as e:  # noqa: BLE001 - the blocks are recomputed instead
                pool.free_blocks(fresh)
                logger.warning(
                    "KV offload: loading %d blocks failed (%s: %s); recomputing them", len(fresh), type(e).__name__, e
                )
                return hits
            fresh_it, start = iter(fresh), len(hits)
            for i, item in enumerate(plan):
                if isinstance(item, bytes):
                    block = next(fresh_it)
                    pool.cache_full_block(block, hashes[start + i])
                    self._loaded[block.block_id] = hashes[start + i]
                    plan[i] = block
            pool.free_blocks(reversed(fresh))  # free and cached, like a finished request's blocks
        finally:
            pool.free_blocks(reversed(device))
        self.loaded_blocks += len(fresh)
        self.load_seconds += time.perf_counter() - t0
        return hits + [b for b in plan if isinstance(b, KVBlock)]  # every tier key was replaced above

    def record_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        """Count an admitted request's tokens (once, like the device prefix-cache counters)."""
        self.query_tokens += seq.num_tokens
        for block in seq.blocks[: num_hit_tokens // self.block_size]:
            if self._loaded.get(block.block_id) == block.block_hash:
                del self._loaded[block.block_id]
                self.hit_tokens += self.block_size

    # -- management -------------------------------------------------------------------------------
    def rebind(self, model_path: Path, model_dtype: torch.dtype, cache: KVCache) -> None:
        """Follow a swapped cache (``LLMEngine.replace_kv_cache``): new layout, new namespace."""
        self.io = CacheBlockIO(cache)
        self.namespace = namespace_digest(model_path, model_dtype, cache)
        self._loaded.clear()
        self._computed.clear()

    def clear(self) -> None:
        """Empty the tier (a benchmark's cold start)."""
        self._computed.clear()
        self.tier.clear()
        self.flush()
        self._loaded.clear()

    def flush(self, timeout: float | None = None) -> int:
        """Wait for a file tier's queued writes, at most ``timeout`` s; returns those left (0 for RAM)."""
        self.write_through()
        return self.tier.backend.flush(timeout)

    def close(self, timeout: float | None = None) -> int:
        """Store what is pending and stop a file tier's writer; returns the writes dropped at ``timeout``."""
        self.write_through()
        return self.tier.backend.close(timeout)

    def counters(self) -> dict[str, float]:
        """The values of :data:`OFFLOAD_COUNTERS` and :data:`OFFLOAD_GAUGES`."""
        t = self.tier
        return {
            "external_prefix_cache_queries": self.query_tokens,
            "external_prefix_cache_hits": self.hit_tokens,
            "kv_offload_stored_blocks": self.stored_blocks,
            "kv_offload_skipped_blocks": t.skipped,
            "kv_offload_loaded_blocks": self.loaded_blocks,
            "kv_offload_bytes_written": t.bytes_written,
            "kv_offload_bytes_read": t.bytes_read,
            "kv_offload_store_seconds": self.store_seconds,
            "kv_offload_load_seconds": self.load_seconds,
            "kv_offload_bad_entries": t.bad_entries,
            "kv_offload_used_bytes": t.used,
            "kv_offload_entries": len(t),
            "kv_offload_write_queue_bytes": t.backend.pending_bytes,
        }

    def report(self) -> dict:
        """What ``/debug/kv`` shows of the tier."""
        return {
            **self.tier.report(),
            "block_bytes": self.io.block_bytes,
            "capacity_blocks": self.tier.capacity // self.io.block_bytes,
            "namespace": self.namespace.hex()[:16],
            **self.counters(),
        }


def build_offload(
    config, model_path: Path, model_dtype: torch.dtype, cache: KVCache, pool: BlockPool, kv_manager
) -> KVOffload | None:
    """The tier ``config`` asks for, hooked into ``pool`` and ``kv_manager``; ``None`` when it is off."""
    if config.kv_offloading_size is None:
        return None
    capacity = int(config.kv_offloading_size * 2**30)
    backend = BackgroundWriter(FileBackend(config.kv_offloading_dir)) if config.kv_offloading_dir else RamBackend()
    io = CacheBlockIO(cache)
    offload = KVOffload(
        OffloadTier(capacity, backend), io, namespace_digest(model_path, model_dtype, cache), cache.block_size
    )
    pool.on_evict = offload.on_evict
    kv_manager.offload = offload  # notes computed blocks (on_computed) and extends prefix walks (extend_hits)
    where = f"files in {config.kv_offloading_dir}" if config.kv_offloading_dir else "RAM"
    found = f", {offload.tier.found_at_start} entries found there" if config.kv_offloading_dir else ""
    logger.info(
        "KV offload tier (native, %s): %.2f GiB = %d blocks of %d B%s",
        where,
        config.kv_offloading_size,
        capacity // io.block_bytes,
        io.block_bytes,
        found,
    )
    return offload


def evict_free_blocks(pool: BlockPool) -> None:
    """Evict every free cached block through the real path (allocate all free blocks, release them).

    The device keeps none of them cached (the tier has had their bytes since they were computed).
    Benchmarks and tests use it to turn a device hit into a tier hit.
    """
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))
