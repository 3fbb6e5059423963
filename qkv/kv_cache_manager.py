"""Per-sequence block tables on top of the :class:`BlockPool`, with automatic prefix caching."""

from __future__ import annotations

from .block_pool import BlockPool, KVBlock
from .sequence import Sequence

__all__ = ["KVCacheManager"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares and frees the blocks of each sequence.

    A sequence's block list *is* its block table: block ``i`` holds tokens
    ``[i * block_size, (i + 1) * block_size)``. Full blocks are published in the
    prefix cache by their chained hash right after their tokens are written.

    Parallel sampling shares blocks between a request's samples by reference
    count (:meth:`fork`). A sample about to write into a partly filled block
    that others still hold gets a private copy first: copy-on-write. The copy
    is queued as ``(src, dst)`` block ids, which the scheduler hands to the
    runner to do before the step's forward (:meth:`take_copies`).
    """

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens of admitted requests, looked up in the prefix cache
        self.prefix_hits = 0  # tokens of those found there
        self.offload = None  # a qkv.offload.KVOffload when the second tier is on (the engine sets it)
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) block ids not yet done
        self.num_copies = 0  # copy-on-write block copies handed out since start

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of cached full blocks that starts the sequence.

        At least one token is always left to compute: the step must produce
        logits for the last token, so a fully cached prompt gives back its last
        block (vLLM does the same). It takes no reference: the scheduler may look
        a request up many times before blocks are free to admit it, so the
        metrics are counted by :meth:`record_admission`, once. With the offload
        tier, the walk goes on there after a device miss, and tier hits are
        loaded into free device blocks, published and left free: ordinary hits,
        which later lookups find in the device pool.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[KVBlock] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                if self.offload is not None:
                    return self.offload.extend_hits(self.pool, seq.block_hashes[:max_blocks], hits)
                break
            hits.append(block)
        return hits

    def record_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        """Count a request's prefix-cache query and hits when it is first admitted.

        Re-admission after a preemption recomputes a request that was already
        counted; like vLLM, which keeps those in separate counters, it is left
        out of the query and hit counts (it shows in the preemption count).
        """
        if self.enable_prefix_caching and seq.metrics.num_preemptions == 0:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit_tokens
            if self.offload is not None:
                self.offload.record_admission(seq, num_hit_tokens)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens; ``False`` (and no change) if blocks run out.

        ``computed_blocks`` are prefix-cache hits for a sequence that has no
        blocks yet; they are referenced first, so allocation cannot evict them.
        """
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(seq.blocks) - len(computed_blocks)
        cow = self._shared_write_block(seq, num_new_tokens)
        # Hits that are free (ref 0) are still counted in num_free_blocks: do not allocate them twice.
        evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + (cow is not None) > self.pool.num_free_blocks - evictable_hits:
            return False
        if cow is not None:
            self._copy_on_write(seq, cow)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            seq.blocks.extend(computed_blocks)
            seq.num_computed_tokens = num_computed
            seq.num_cached_blocks = len(seq.blocks)  # hits are published already
            seq.metrics.num_cached_tokens = num_computed
        if need > 0:
            seq.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """Publish the blocks whose tokens became all computed (call after the step's forward).

        Resumes at ``seq.num_cached_blocks``, so a long sequence costs the same per step as a short one.
        With the offload tier, each newly full block is also noted for the tier's write-through.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache_full_block(seq.blocks[i], seq.block_hashes[i])
            if self.offload is not None:  # write-through: the tier stores it at the end of the step
                self.offload.on_computed(seq.blocks[i], seq.block_hashes[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` every block of ``parent``, partly filled last block included (ref counts +1)."""
        self.pool.touch(parent.blocks)
        child.blocks = list(parent.blocks)

    def _shared_write_block(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Index of the block this step writes into first, if another sequence holds it too."""
        i = seq.num_computed_tokens // self.block_size
        if num_new_tokens > 0 and i < len(seq.blocks) and seq.blocks[i].ref_cnt > 1:
            return i
        return None

    def _copy_on_write(self, seq: Sequence, i: int) -> None:
        """Swap block ``i`` for a private copy; the others keep the original (its ref count drops by one)."""
        shared = seq.blocks[i]
        (private,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([shared])
        seq.blocks[i] = private
        self._copies.append((shared.block_id, private.block_id))

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copy-on-write ``(src, dst)`` pairs, in order; the caller must copy before writing."""
        copies, self._copies = self._copies, []
        self.num_copies += len(copies)
        return copies

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so its prefix stays cached longest."""
        if self._copies:  # preempted in the step that copied: its private copy is freed, not filled
            mine = {b.block_id for b in seq.blocks}
            self._copies = [(s, d) for s, d in self._copies if d not in mine]
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
