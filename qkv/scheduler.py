"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (``max_num_batched_tokens``). Running sequences
are served first, in arrival order: a decode takes one token, an unfinished
prefill takes what is left of its prompt, clipped to the budget (chunked
prefill). When the pool cannot give a running sequence the blocks it needs,
the *newest* running sequence is preempted: its blocks are freed and it goes
back to the front of the waiting queue to be recomputed later (vLLM's
``RECOMPUTE`` policy). Waiting sequences are admitted while budget, blocks and
``max_num_seqs`` allow, starting from their prefix-cache hits.

The samples of a parallel-sampling request are sequences like any other: a
request counts for all its samples against ``max_num_seqs`` from its
admission, its forks join the running list after the prefill
(:meth:`Scheduler.add_forks`), and preempting one sample frees only its own
block references. A request that wants prompt logprobs is prefilled without
prefix-cache hits until they are all computed (as vLLM does): a hit has no logits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledSeq"]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_alloc_failures = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        # 1. Running sequences, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                self.num_alloc_failures += 1
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # the sequence itself was preempted; everything after it is gone too

        # 2. Waiting sequences, FIFO, while nothing was preempted this step.
        num_seqs = len(self.running) + sum(s.num_forks_pending for s in self.running)
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            if num_seqs + 1 + seq.num_forks_pending > self.max_num_seqs:
                break
            hits = self.kv.get_computed_blocks(seq) if not seq.blocks and not seq.needs_prompt_logprobs else []
            cached = len(hits) * self.kv.block_size
            n = min(seq.num_tokens - seq.num_computed_tokens - cached, budget)
            if not self.kv.allocate_slots(seq, n, hits):
                self.num_alloc_failures += 1
                break
            self.kv.record_admission(seq, cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            self.running.append(seq)
            num_seqs += 1 + seq.num_forks_pending
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        out.block_copies = self.kv.take_copies()
        return out

    def add_forks(self, children: list[Sequence]) -> None:
        """Run a request's new samples, forked from a running sequence whose blocks they share."""
        for child in children:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
