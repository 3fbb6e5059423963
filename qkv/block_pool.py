"""Physical KV blocks: an O(1) free list, reference counts and the prefix-cache map.

The design follows vLLM v1's ``block_pool.py``:

* Block 0 is the *null block*. It is never handed out, so a block table can be
  padded with 0 and a stray read lands on memory no sequence owns.
* Free blocks live in a doubly linked queue. The head is the least recently
  used block: allocation pops from the head, freeing appends to the tail.
* A block whose tokens are all known gets a *block hash* (chained over the
  prefix, see :func:`hash_block_tokens`). A hit is used without comparing
  tokens, so the hash must be collision resistant: it is SHA-256 over a
  canonical byte encoding, never Python's ``hash()``, whose tuple hash of ints
  is deterministic and invertible, so a client could craft a prompt whose
  blocks collide with another client's (vLLM advisory GHSA-rm76-4mrf-v9r8;
  ``scripts/find_block_hash_collision.py`` finds such blocks in a minute).
  When its last user frees a block, it stays
  in the queue **with** its hash: it is free but still *cached*. A later request
  with the same prefix can take it back (``touch``) until allocation evicts it
  from the head of the queue. That gives LRU eviction of cached prefixes
  without any extra bookkeeping.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence

BlockHash = bytes

__all__ = [
    "KVBlock",
    "FreeBlockQueue",
    "BlockPool",
    "hash_block_tokens",
    "NULL_BLOCK_ID",
    "HASH_ALGOS",
    "DEFAULT_HASH_ALGO",
]

NULL_BLOCK_ID = 0

# ``--prefix-caching-hash-algo`` choices (vLLM's flag). Only a cryptographic hash is offered: on this engine a
# block hash costs about 3 µs against milliseconds per model step, so a fast non-cryptographic
# option (vLLM's xxhash) would buy nothing and reopen the collision attack.
HASH_ALGOS = ("sha256",)
DEFAULT_HASH_ALGO = "sha256"
_ROOT = bytes(32)  # the "parent" of a sequence's first block


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"", algo: str = DEFAULT_HASH_ALGO
) -> BlockHash:
    """SHA-256 of one full block, chained on its parent's hash (a 32-byte digest).

    Chaining makes a block's identity depend on the whole prefix, so two
    sequences share a block only if every token before it is the same too.
    The encoding is canonical and injective: the 32-byte parent digest (zeros
    for a first block), the token count and every token id as big-endian
    unsigned 32/64-bit integers, then the length of ``extra_keys`` and its bytes.
    A request's ``cache_salt`` is the first block's extra key, so through the
    chain it isolates every block of that request's prefix.
    """
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
    h = hashlib.sha256(_ROOT if parent is None else parent)
    h.update(struct.pack(f">I{len(token_ids)}Q", len(token_ids), *token_ids))
    h.update(struct.pack(">I", len(extra_keys)))
    h.update(extra_keys)
    return h.digest()


class KVBlock:
    """Metadata of one physical block; the bytes live in the per-layer cache tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash[:6].hex()
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, append and removal from the middle.

    Removal from the middle is what a prefix-cache hit on a free block needs; a
    ``collections.deque`` would make that O(n).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def ids(self) -> list[int]:
        """Block ids from LRU (next to be evicted) to MRU; for tests and debugging."""
        out, b = [], self._head.next
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next
        return out


class BlockPool:
    """All blocks of the cache; every layer uses the same block ids."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # permanently owned, never freed
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVBlock] = {}
        # Called with (block id, hash) of the cached blocks an allocation evicts, while their bytes are
        # still intact: the offload tier (qkv.offload) saves them there. None (the default) costs nothing.
        self.on_evict: Callable[[list[tuple[int, BlockHash]]], None] | None = None

    # -- allocation -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, whether or not still cached)."""
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence (parallel samples, or requests on the same prefix)."""
        return sum(1 for b in self.blocks[1:] if b.ref_cnt > 1)

    def usage(self) -> float:
        """Fraction of usable blocks held by running sequences (cached-but-free counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the LRU end, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        evicted: list[tuple[int, BlockHash]] | None = [] if self.on_evict is not None else None
        for _ in range(n):
            block = self.free_queue.popleft()
            if evicted is not None and block.block_hash is not None and self.cached.get(block.block_hash) is block:
                evicted.append((block.block_id, block.block_hash))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    # -- prefix cache -----------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a block whose tokens are all written. First writer wins on a duplicate hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    # -- release ----------------------------------------------------------
    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the tail in the given order.

        Callers pass a sequence's blocks in *reverse*, so its tail blocks (least
        likely to be shared) are evicted before its prefix blocks.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0 and block is not self.null_block, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def check_no_leaks(self) -> None:
        """Raise if any block other than the null block is still referenced."""
        held = [b for b in self.blocks[1:] if b.ref_cnt != 0]
        if held or self.num_free_blocks != self.num_usable_blocks:
            raise AssertionError(f"leaked blocks: {held[:8]} (free {self.num_free_blocks}/{self.num_usable_blocks})")
