"""One request's state as the scheduler and runner see it, and the outputs it yields."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from .block_pool import DEFAULT_HASH_ALGO, BlockHash, KVBlock, hash_block_tokens
from .detokenizer import IncrementalDetokenizer
from .logprobs import Logprob, PositionLogprobs
from .sampling import SamplingParams

__all__ = ["SequenceStatus", "Sequence", "CompletionOutput", "RequestOutput", "RequestMetrics"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why the engine aborted the request (finish_reason "abort"), if it failed
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when they were computed
    logprobs: list[PositionLogprobs] | None = None  # per sampled token, with SamplingParams.logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first token, as in vLLM


class Sequence:
    """Token ids, KV blocks and progress of one request.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. Prefill
    (also after preemption, which recomputes prompt *and* generated tokens)
    advances it in chunks; each decode step advances it by one.

    Per token, the work is constant: token lists and block hashes are appended
    to, never rebuilt, and ``num_cached_blocks`` tells the KV manager where
    publishing full blocks resumes. ``cache_salt`` enters the first block's
    hash, so requests with different salts never share a cached block.

    A request with ``n``/``best_of`` > 1 starts as one sequence, sample 0,
    with ``num_forks_pending`` siblings still to come; :meth:`fork` makes them
    once the prompt is prefilled (``qkv/parallel_sampling.py``).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        hash_algo: str = DEFAULT_HASH_ALGO,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.blocks: list[KVBlock] = []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0  # leading blocks already published in the prefix cache
        self.block_hashes: list[BlockHash] = []
        self.cache_salt = cache_salt
        self.hash_algo = hash_algo
        self.detokenizer = detokenizer
        self.output_text = ""
        self.stop_checked = 0  # output_text before this offset was searched for stop strings
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.index = 0  # sample index within its request
        self.num_forks_pending = 0  # siblings this sequence still forks into after its prefill
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self._update_block_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output ids: the sequence's own list, to read and not to modify."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, logprobs: PositionLogprobs | None = None) -> None:
        """Append a sampled token; ``logprobs`` (its position's, chosen token first) when they were computed."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self._update_block_hashes()
        if logprobs is not None:
            chosen: Logprob = logprobs[token_id]
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + chosen.logprob
            if self.logprobs is not None:
                self.logprobs.append(logprobs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still missing (so no prefix-cache hits may be used)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_logprob_positions(self, start: int, num_new_tokens: int) -> range:
        """Positions of a chunk ``[start, start + n)`` whose logits give prompt logprobs still missing.

        Position ``p``'s logits score prompt token ``p + 1``; token 0 has none. A
        recompute after preemption finds them recorded and computes none again.
        """
        if self.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs) - 1)
        return range(first, max(first, min(start + num_new_tokens, self.num_prompt_tokens - 1)))

    def fork(self, index: int, params: SamplingParams, detokenizer: IncrementalDetokenizer) -> Sequence:
        """Sample ``index`` of this request: the same tokens and progress, its own params and generator.

        The child has no blocks: :meth:`KVCacheManager.fork` shares this
        sequence's blocks with it by reference count. It shares the
        :class:`RequestMetrics` object, whose times and preemptions are the
        request's, and the prompt logprobs, which belong to the prompt.
        """
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.index, child.params, child.detokenizer = index, params, detokenizer
        child.num_forks_pending = 0
        child.output_token_ids = list(self.output_token_ids)
        child._all_token_ids = list(self._all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.blocks = []
        child.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        child.logprobs = None if params.logprobs is None else list(self.logprobs or [])
        return child

    def _update_block_hashes(self) -> None:
        """Extend the chained hashes to every block that is now full of known tokens."""
        tokens = self._all_token_ids
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = b"" if i or self.cache_salt is None else self.cache_salt.encode("utf-8", "surrogatepass")
            self.block_hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra, self.hash_algo))

    def finish_reason(self) -> str | None:
        return self.status.value if self.finished else None

    def completion(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index,
            self.output_text,
            list(self.output_token_ids),
            self.finish_reason(),
            self.stop_reason,
            self.error,
            self.cumulative_logprob,
            None if self.logprobs is None else list(self.logprobs),
        )
