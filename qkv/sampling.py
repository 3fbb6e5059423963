"""Sampling parameters (vLLM's names and defaults) and the batched sampler."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch

from .options import option

__all__ = ["SamplingParams", "SamplingError", "sample", "SEED_MIN", "SEED_MAX", "MAX_SAMPLES", "MAX_LOGPROBS"]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_SAMPLES = 128  # n and best_of: one request may hold at most this many sequences
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's top_logprobs limit, vLLM's default max_logprobs)


def _is_int(x) -> bool:
    """An integer (numpy's too), but not a bool: ``top_k=True`` is a mistake, not 1."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _bad(name: str, want: str, value) -> ValueError:
    return ValueError(f"{name} must be {want}, got {value!r}")


@dataclass
class SamplingParams:
    """Per-request decoding options, shaped like ``vllm.SamplingParams``.

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k. A ``seed``
    gives the request its own generator, so its samples do not depend on what
    else is batched with it.

    Parallel sampling: the request runs ``best_of`` samples (default ``n``) on
    the prompt's shared blocks and returns ``n``; with ``best_of > n``, the ``n``
    with the highest cumulative logprob. Sample ``i`` draws from its own
    generator seeded with ``seed + i`` (vLLM's rule), so ``n=4, seed=s`` gives
    what four requests with seeds ``s .. s+3`` give; without a seed every
    sample draws from the global generator, so samples differ.

    ``logprobs=k`` returns each sampled token's logprob and the top ``k``
    alternatives; ``prompt_logprobs=k`` the same for every prompt token after
    the first. Both are *raw* logprobs (vLLM's default ``logprobs_mode``): the
    ``log_softmax`` of the model's fp32 logits, before temperature, top-k and
    top-p, i.e. of the very logits the sampler was handed (see ``qkv/logprobs.py``).

    Every field is checked, type and range, when the object is built, and the
    error names the field: a bad value must fail here, in the caller's hands,
    not inside an engine step where other requests share the batch. The engine
    checks again when a request is added, in case a field was changed since.
    """

    n: int = option(1, f"samples returned per prompt (1-{MAX_SAMPLES})")
    temperature: float = option(1.0, "sampling temperature; 0 is greedy")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches top_p")
    top_k: int = option(0, "sample among the k most likely tokens (0 or -1: all)")
    seed: int | None = option(None, "seed of the request's own generator (default: the global one)")
    max_tokens: int | None = option(16, "most tokens to generate")
    stop: list[str] | str | None = option(None, "stop at this string (repeat the flag for several)", append=True)
    stop_token_ids: list[int] = option(help="stop at these token ids", default_factory=list, cli=False)
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")
    min_tokens: int = option(0, "tokens to generate before EOS or a stop can end the output")
    skip_special_tokens: bool = option(True, "leave special tokens out of the text", cli=False)
    best_of: int | None = option(None, "samples to run, of which the n most likely are returned", cli=False)
    logprobs: int | None = option(None, f"logprobs of the sampled token and the top k (<= {MAX_LOGPROBS})", cli=False)
    prompt_logprobs: int | None = option(None, "the same for every prompt token after the first", cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()
        # Plain Python numbers from here on (numpy scalars are accepted above).
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.n, self.top_k, self.min_tokens = int(self.n), int(self.top_k), int(self.min_tokens)
        for name in ("best_of", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        self.seed = None if self.seed is None else int(self.seed)
        self.max_tokens = None if self.max_tokens is None else int(self.max_tokens)
        self.stop_token_ids = [int(i) for i in self.stop_token_ids]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that has a wrong type or value."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise _bad("n", f"an integer in [1, {MAX_SAMPLES}]", self.n)
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_SAMPLES):
            raise _bad("best_of", f"None or an integer in [n, {MAX_SAMPLES}] (n is {self.n})", self.best_of)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise _bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]", v)
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise _bad("temperature", "a finite number >= 0 (0 is greedy)", t)
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", "a number in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", "an integer >= -1 (0 or -1 disables)", self.top_k)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise _bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}] or None", self.seed)
        if self.seed is not None and self.seed + self.num_samples - 1 > SEED_MAX:
            raise _bad(
                "seed",
                f"at most {SEED_MAX - self.num_samples + 1}, so that every sample's seed "
                f"(seed + i for i < {self.num_samples}) is valid",
                self.seed,
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", "an integer >= 1 or None", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", "a non-empty string or a list of non-empty strings", self.stop)
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(i) and i >= 0 for i in self.stop_token_ids):
            raise _bad("stop_token_ids", "a list of integers >= 0", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "true or false", getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: ``best_of``, or ``n`` without it."""
        return self.n if self.best_of is None else self.best_of

    def for_sample(self, i: int) -> SamplingParams:
        """The params of sample ``i``: a single sequence seeded ``seed + i`` (sample 0 keeps this object)."""
        if i == 0:
            return self
        return replace(self, n=1, best_of=None, seed=None if self.seed is None else self.seed + i)


_FP32_TINY = torch.finfo(torch.float32).tiny


class SamplingError(Exception):
    """One row of a batch could not be sampled; :func:`sample` returns it in that row's place."""


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False  # even when top_p is below fp32's range (rounds to 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, idx, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: list[int] | None = None,
) -> list[int | SamplingError]:
    """Pick one token per row of ``logits`` ([N, vocab]).

    Greedy rows take the fp32 argmax, exactly what ``transformers.generate``
    does, so greedy outputs can be compared token for token. A temperature so
    small that ``logits / temperature`` leaves the float range is computed
    relative to the largest logit (and below fp32's range, is greedy). A row that still fails (NaN logits) yields a
    :class:`SamplingError` in its place, so the engine can abort that request
    alone and keep the batch going. ``greedy``: the rows' argmax, when the caller already has it.
    """
    logits = logits.to(torch.float32)
    out: list[int | SamplingError] = []
    if greedy is None:
        greedy = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        try:
            if p.greedy or p.temperature < _FP32_TINY:  # below fp32's range the limit is greedy
                out.append(greedy[i])
                continue
            row = logits[i] / p.temperature
            if not bool(torch.isfinite(row.max())):
                # A tiny temperature overflowed (or underflowed every logit to -inf): scale the logits
                # relative to their maximum instead, which is the same distribution, computable.
                row = (logits[i] - logits[i].max()) / p.temperature
            row = _filter_top_k_top_p(row, p.top_k, p.top_p)
            probs = row.softmax(-1)
            out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
        except Exception as e:  # noqa: BLE001 - reported per request by the engine
            out.append(SamplingError(f"sampling failed: {type(e).__name__}: {e}"))
    return out
