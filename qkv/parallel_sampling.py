"""One request's samples (``n``, ``best_of``) on shared KV blocks, and the output that gathers them.

vLLM v0's design, which the issue asks for: the prompt is prefilled once, by
sample 0. In the step whose forward reaches the end of the prompt, sample 0
forks into its siblings (:meth:`ParallelRequest.fork`); every sibling
references every block of the prompt, the partly filled last one included
(ref counts, :meth:`KVCacheManager.fork`), and each samples its first token
from the same logits row with its own generator. So a prompt of ``P`` full
blocks costs ``P + best_of x (tail blocks)`` during decode, not
``best_of x P``. The first write into the shared partly filled block copies it
(copy-on-write, :meth:`KVCacheManager.allocate_slots`); full blocks stay
shared. Each sample is then a sequence of its own for the scheduler:
preempting one frees only its references and recomputes it alone, its
generator untouched (a recompute samples nothing until it is back at its end).

**Seeds**: sample ``i`` uses ``seed + i`` (vLLM's rule,
:meth:`SamplingParams.for_sample`). ``n=4, seed=s`` therefore gives the
outputs of four ``n=1`` requests with seeds ``s, s+1, s+2, s+3``.

**best_of**: ``best_of`` samples run; the output holds the ``n`` with the
highest cumulative logprob (raw logprobs, as reported; ties keep sample
order), numbered ``0 .. n-1`` best first. Until the request finishes they
are ranked by the logprob so far.
"""

from __future__ import annotations

from collections.abc import Callable

from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .sampling import SamplingParams
from .sequence import CompletionOutput, RequestOutput, Sequence

__all__ = ["ParallelRequest"]


class ParallelRequest:
    """The sequences of one request: sample 0 from the start, the others from its fork on."""

    def __init__(self, first: Sequence) -> None:
        self.request_id = first.request_id
        self.params: SamplingParams = first.params
        self.seqs = [first]
        first.num_forks_pending = self.params.num_samples - 1

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def needs_cumulative_logprob(self) -> bool:
        """``best_of`` ranks samples by cumulative logprob, so every sampled token's logprob is computed."""
        return self.params.num_samples > self.params.n

    @property
    def finished(self) -> bool:
        """Every sample is done (before the fork: sample 0 was aborted, and the forks never come)."""
        return all(s.finished for s in self.seqs)

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    def fork(
        self, seq: Sequence, kv: KVCacheManager, detokenizer: Callable[[SamplingParams], IncrementalDetokenizer]
    ) -> list[Sequence]:
        """Sample 0's siblings, sharing its blocks; called once, when it is about to sample its first token."""
        assert seq is self.first and seq.num_forks_pending == self.params.num_samples - 1
        children = []
        for i in range(1, self.params.num_samples):
            params = self.params.for_sample(i)
            child = seq.fork(i, params, detokenizer(params))
            kv.fork(seq, child)
            children.append(child)
        seq.num_forks_pending = 0
        self.seqs.extend(children)
        return children

    def output(self) -> RequestOutput:
        """The request's ``n`` outputs (the best ``n`` of ``best_of``), finished when every sample is."""
        first, params = self.first, self.params
        comps = [s.completion(s.index) for s in self.seqs]
        for i in range(len(comps), params.num_samples):  # never forked: sample 0 ended before its first token
            comps.append(CompletionOutput(i, "", [], first.finish_reason(), None, first.error))
        if params.num_samples > params.n:
            comps = sorted(comps, key=_rank_key)[: params.n]
            for rank, c in enumerate(comps):
                c.index = rank
        return RequestOutput(
            self.request_id,
            first.prompt,
            first.prompt_token_ids,
            comps,
            self.finished,
            first.metrics,
            first.metrics.num_cached_tokens,
            first.prompt_logprobs,
        )  # complete before any output (none during prefill)


def _rank_key(c: CompletionOutput) -> float:
    """Best first: the highest cumulative logprob; an output with none (never sampled) last."""
    return float("inf") if c.cumulative_logprob is None else -c.cumulative_logprob
