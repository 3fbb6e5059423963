"""A second tier for prefix-cache blocks: evicted blocks go to RAM or files and come back on a hit.

vLLM's native CPU offload and LMCache keep KV blocks that the GPU pool drops in a larger, slower
store; qkv does the same with its 8-bit blocks (``--kv-offloading-size GiB``, optionally backed by
files under ``--kv-offloading-dir`` so that the tier survives restarts):

* **Store on eviction.** ``BlockPool.get_new_blocks`` hands the cached blocks it evicts to
  :meth:`KVOffload.on_evict` *before* returning them for reuse, so their bytes are still intact.
  One ``index_select`` per layer tensor gathers all of them (K/V rows, plus the dynamic
  per-token-head scales), and each block becomes one entry (:mod:`qkv.offload_tier`).
* **Load on a device miss.** ``KVCacheManager.get_computed_blocks`` walks a request's block hashes
  in the device pool; at the first miss it hands the walk to :meth:`KVOffload.extend_hits`, which
  continues along the same chain (device first, then the tier), reads the tier entries, copies
  them into fresh device blocks (one ``index_copy_`` per layer tensor) and publishes those under
  the same hashes. Afterwards the state is exactly as if a finished request had computed and
  freed them: free, cached blocks the scheduler then references as ordinary prefix hits.
* **The key** is ``sha256(namespace || block hash)``. The block hash is the SHA-256 chain over the
  whole prefix, with the request's ``cache_salt`` in the first block; the namespace
  (:func:`namespace_digest`) covers what else decides the bytes: the model (name, config and
  weight files), the model dtype, the block size, every layer's cache dtype, shape and rotation,
  the bytes of every static scale, and the entry format. Bytes are reused only where they would
  be recomputed identically up to batch effects, exactly like the device prefix cache.

With no ``--kv-offloading-size`` none of this is built: the pool's hook is ``None`` and a device
miss costs one ``is None`` test.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from .block_pool import BlockHash, BlockPool, KVBlock
from .kv_cache import KVCache
from .offload_files import FileBackend
from .offload_tier import OffloadTier, RamBackend
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

ENTRY_FORMAT_VERSION = 1  # the payload layout: per layer, the block's K/V rows then its dynamic scales
OFFLOADING_BACKENDS = ("native",)  # vLLM also has "lmcache"; qkv does not implement it
_EDGE = 1 << 20  # bytes hashed at each end of a weight file for the model identity

# Counters for /metrics (qkv.server.metrics), named after vLLM's connector families where they exist.
OFFLOAD_COUNTERS = {
    "external_prefix_cache_queries": "Prompt tokens of admitted requests looked up with the offload tier on.",
    "external_prefix_cache_hits": "Prompt tokens of admitted requests whose KV came from the offload tier.",
    "kv_offload_stored_blocks": "Blocks written to the offload tier when the device pool evicted them.",
    "kv_offload_loaded_blocks": "Blocks loaded from the offload tier into the device pool.",
    "kv_offload_bytes_written": "Payload bytes written to the offload tier.",
    "kv_offload_bytes_read": "Payload bytes read back from the offload tier.",
    "kv_offload_store_seconds": "Seconds spent copying evicted blocks into the offload tier.",
    "kv_offload_load_seconds": "Seconds spent loading blocks from the offload tier (part of those requests' TTFT).",
    "kv_offload_bad_entries": "Offload entries that failed their checks (corrupt, truncated) and were recomputed.",
}
OFFLOAD_GAUGES = {
    "kv_offload_used_bytes": "Bytes held by the offload tier (its cap is --kv-offloading-size).",
    "kv_offload_entries": "Blocks held by the offload tier.",
}


def _model_identity(model_path: Path) -> dict:
    """Name, config digest and weight files of a checkpoint directory.

    Each weight file counts with its size and the SHA-256 of its first and last MiB: hashing
    gigabytes at every start would cost seconds, while any retrained or requantized checkpoint
    differs in its header or first tensors.
    """
    config = model_path / "config.json"
    weights = []
    for f in sorted([*model_path.glob("*.safetensors"), *model_path.glob("*.bin")]):
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            fh.seek(max(0, size - _EDGE))
            h.update(fh.read(_EDGE))
        weights.append([f.name, size, h.hexdigest()])
    return {
        "name": model_path.name,
        "weights": weights,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
    }


def namespace_digest(model_path: Path, model_dtype: torch.dtype, cache: KVCache) -> bytes:
    """The engine-level part of every tier key: what, besides the tokens, decides a block's bytes."""
    material = {
        "entry_format": ENTRY_FORMAT_VERSION,
        "model": _model_identity(Path(model_path)),
        "model_dtype": str(model_dtype),
        "block_size": cache.block_size,
        "layers": [
            [s.layer_idx, s.num_kv_heads, s.head_dim, s.dtype.name, str(s.dtype.storage), s.rotation]
            for s in cache.specs
        ],
    }
    h = hashlib.sha256(json.dumps(material, sort_keys=True).encode())
    for layer in cache.layers:  # static scales, every byte (a recalibration changes the quantized bytes)
        for t in (layer.k_scale, layer.v_scale):
            raw = b"" if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            h.update(len(raw).to_bytes(8, "big") + raw)
    return h.digest()


class CacheBlockIO:
    """Whole blocks of every layer as bytes: each layer tensor seen as ``[num_blocks, bytes per block]``."""

    def __init__(self, cache: KVCache) -> None:
        self.views: list[torch.Tensor] = []
        for layer in cache.layers:
            for t in (layer.kv, layer.scale_cache):
                if t is not None:  # a uint8 view of the same memory, one row per block
                    self.views.append(t.view(torch.uint8).reshape(cache.num_blocks, -1))
        self.block_bytes = sum(v.shape[1] for v in self.views)
        self.device = self.views[0].device

    def gather(self, block_ids: list[int]) -> list[bytes]:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        rows = torch.cat([v.index_select(0, idx) for v in self.views], dim=1).cpu()
        return [r.numpy().tobytes() for r in rows]

    def scatter(self, block_ids: list[int], payloads: list[bytes]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        data = data.reshape(len(block_ids), self.block_bytes).to(self.device)
        col = 0
        for v in self.views:
            v.index_copy_(0, idx, data[:, col : col + v.shape[1]])
            col += v.shape[1]


class KVOffload:
    """Connects the device pool to the tier: stores evicted blocks, loads tier hits, counts both."""

    def __init__(self, tier: OffloadTier, io, namespace: bytes, block_size: int) -> None:
        self.tier, self.io, self.namespace, self.block_size = tier, io, namespace, block_size
        self.stored_blocks = self.loaded_blocks = 0
        self.store_seconds = self.load_seconds = 0.0
        self.query_tokens = self.hit_tokens = 0
        self.store_errors = 0
        self._loaded: dict[int, BlockHash] = {}  # device blocks loaded from the tier, not yet credited

    def key(self, block_hash: BlockHash) -> bytes:
        return hashlib.sha256(self.namespace + block_hash).digest()

    # -- device -> tier ---------------------------------------------------------------------------
    def on_evict(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """``BlockPool``'s hook: the cached blocks one allocation just evicted, bytes still intact."""
        t0 = time.perf_counter()
        todo: list[tuple[int, bytes]] = []
        for block_id, block_hash in evicted:
            self._loaded.pop(block_id, None)
            key = self.key(block_hash)
            if key in self.tier:
                self.tier.touch(key)
            else:
                todo.append((block_id, key))
        if not todo:
            return
        try:  # the allocation path must not fail because the tier did
            for (_, key), payload in zip(todo, self.io.gather([b for b, _ in todo])):
                self.stored_blocks += self.tier.put(key, payload)
        except Exception as e:  # noqa: BLE001
            self.store_errors += 1
            if self.store_errors == 1:
                logger.warning(
                    "KV offload: storing evicted blocks failed (%s: %s); going on without them", type(e).__name__, e
                )
        self.store_seconds += time.perf_counter() - t0

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

    def clear(self) -> None:
        """Empty the tier (a benchmark's cold start)."""
        self.tier.clear()
        self._loaded.clear()

    def counters(self) -> dict[str, float]:
        """The values of :data:`OFFLOAD_COUNTERS` and :data:`OFFLOAD_GAUGES`."""
        t = self.tier
        return {
            "external_prefix_cache_queries": self.query_tokens,
            "external_prefix_cache_hits": self.hit_tokens,
            "kv_offload_stored_blocks": self.stored_blocks,
            "kv_offload_loaded_blocks": self.loaded_blocks,
            "kv_offload_bytes_written": t.bytes_written,
            "kv_offload_bytes_read": t.bytes_read,
            "kv_offload_store_seconds": self.store_seconds,
            "kv_offload_load_seconds": self.load_seconds,
            "kv_offload_bad_entries": t.bad_entries,
            "kv_offload_used_bytes": t.used,
            "kv_offload_entries": len(t),
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
    backend = FileBackend(config.kv_offloading_dir) if config.kv_offloading_dir else RamBackend()
    io = CacheBlockIO(cache)
    offload = KVOffload(
        OffloadTier(capacity, backend), io, namespace_digest(model_path, model_dtype, cache), cache.block_size
    )
    pool.on_evict = offload.on_evict
    kv_manager.offload = offload
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

    With a tier, their bytes go there; the device keeps none of them cached. Benchmarks and
    tests use it to turn a device hit into a tier hit.
    """
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))
