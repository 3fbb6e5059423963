"""LLMEngine: ``add_request`` / ``step`` / ``abort_request``; the loop is scheduler -> runner -> outputs."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from .attention import get_backend
from .block_pool import BlockPool
from .config import EngineConfig, parse_size
from .cpu_linear import linear_modes, resolve_cpu_matmul
from .detokenizer import IncrementalDetokenizer, make_decoder
from .kv_cache import KVCache, capacity_line, plan_num_blocks
from .kv_cache_manager import KVCacheManager, cdiv
from .logprobs import TokenTexts, position_logprobs
from .model_loader import attention_layout, load_config, load_model, load_tokenizer, resolve_dtype, text_config
from .offload import build_offload
from .parallel_sampling import ParallelRequest
from .registry import resolve_model
from .runner import ModelRunner, StepLogits
from .sampling import SamplingError, SamplingParams, sample
from .scales import resolve_kv_cache
from .scheduler import ScheduledSeq, Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus
from .stats import EngineStats
from .stop import check_stop

__all__ = ["LLMEngine", "RequestError"]

logger = logging.getLogger("qkv")


class RequestError(ValueError):
    """A request the engine refuses. ``param`` names the request field at fault, ``code`` a machine-readable
    reason (OpenAI's ``context_length_exceeded``), so that an API can answer with both."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class LLMEngine:
    def __init__(self, config: EngineConfig, preloaded_model: torch.nn.Module | None = None) -> None:
        """``preloaded_model``: another engine's model (same checkpoint, dtype and device) to share,
        so that comparing many cache configurations does not load the weights many times."""
        config.validate()
        self.config = config
        if (config.device or "").startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r}: CUDA is not available on this machine; use device='cpu'")
        self.model_path: Path = resolve_model(config.model)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(self.model_path)
        hf_config = load_config(self.model_path)
        self.dtype = resolve_dtype(config.dtype, text_config(hf_config))
        if preloaded_model is not None:
            p = next(preloaded_model.parameters())
            if p.dtype != self.dtype or p.device.type != self.device.type:
                raise ValueError(
                    f"preloaded model is {p.dtype} on {p.device}, engine wants {self.dtype} on {self.device}"
                )
            self.model = preloaded_model
        else:
            self.model = load_model(self.model_path, self.dtype, self.device)
        self.hf_config = text_config(self.model.config)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]

        layout = attention_layout(self.model)
        self.layer_specs, scales, clips, bases = resolve_kv_cache(
            layout,
            self.model_path,
            config.kv_cache_dtype,
            self.dtype,
            config.kv_scales,
            config.kv_cache_dtype_skip_layers,
            config.kv_rotation,
            config.kv_cache_dtype_skip_dtype,
        )
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            memory = parse_size(config.kv_cache_memory or EngineConfig.DEFAULT_KV_CACHE_MEMORY)
            num_blocks = plan_num_blocks(self.layer_specs, config.block_size, memory)
        self.cache = KVCache(self.layer_specs, num_blocks, config.block_size, self.device, scales, clips, bases)
        self.block_size = config.block_size
        max_pos = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = (
            config.max_model_len
            if config.max_model_len is not None
            else min(max_pos, (num_blocks - 1) * self.block_size)
        )
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # the second tier of prefix blocks (qkv.offload); None unless kv_offloading_size is set
        self.offload = build_offload(config, self.model_path, self.dtype, self.cache, self.pool, self.kv_manager)
        self.backend = get_backend(config.attention_backend, self.device, config.batch_invariant)
        self._prepare(self.cache)
        # how a 16-bit model's linears multiply on a CPU: fp32 upcasts or packed 16-bit GEMMs (qkv.cpu_linear)
        self.cpu_matmul = resolve_cpu_matmul(config.cpu_matmul_dtype, self.dtype, self.device)
        self.matmul_fp32 = self.cpu_matmul == "float32"
        modes = linear_modes(self.model, self.cpu_matmul, config.batch_invariant)
        self.runner = ModelRunner(self.model, self.cache, self.backend, self.device, modes, config.compile_model)
        if self.runner.compiled is not None:
            logger.info(
                "compiled the model in %.1f s (torch.compile; cached for the next start)", self.runner.compiled.seconds
            )
        self.stats = EngineStats()
        self.eos_token_ids = self._eos_ids()
        self._decoders = {skip: make_decoder(self.tokenizer, skip) for skip in (False, True)}
        self.token_text = TokenTexts(self._decoders[False][0])  # names the tokens of logprobs
        self.requests: dict[str, ParallelRequest] = {}
        self._ids = itertools.count()
        self.capacity = capacity_line(self.cache, self.max_model_len)
        logger.info(self.capacity)

    # -- set-up helpers -----------------------------------------------------
    def _prepare(self, cache: KVCache) -> None:
        """Let the attention back end check and describe every layer once, before any step runs."""
        for layer in cache.layers:
            self.backend.prepare(layer)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        return ids

    def replace_kv_cache(
        self, specs: list, scales: dict | None = None, clips: dict | None = None, bases: dict | None = None
    ) -> None:
        """Swap in a cache with other per-layer specs (same block count), e.g. one layer quantized at a time.

        Auto-skip measures each layer's sensitivity this way without reloading the
        model. Only an idle engine may do it: block contents do not survive.
        """
        if self.requests:
            raise RuntimeError("replace_kv_cache needs an idle engine (requests are running)")
        self.pool.reset_prefix_cache()  # cached blocks would hold the old cache's contents
        self.cache = KVCache(specs, self.cache.num_blocks, self.block_size, self.device, scales, clips, bases)
        self._prepare(self.cache)
        self.runner.cache = self.cache
        self.layer_specs = specs
        if self.offload is not None:  # other bytes per block: other tier keys
            self.offload.rebind(self.model_path, self.dtype, self.cache)

    def close(self, timeout: float | None = None) -> int:
        """Finish what outlives the engine: a file tier's queued writes, within ``timeout`` seconds.

        Returns the block writes dropped because the time ran out (0 without a tier).
        """
        return self.offload.close(timeout) if self.offload is not None else 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache.bytes_per_token

    def kv_bytes_per_token_by_layer(self) -> list[int]:
        return [s.bytes_per_token for s in self.layer_specs]

    # -- requests -------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
    ) -> str:
        """Validate and queue a request. Raises :class:`RequestError` before touching any engine state.

        ``cache_salt`` isolates the request's prefix-cache blocks from requests
        with another salt (or none). A ``max_tokens`` that does not fit in
        ``max_model_len`` after the prompt ends the output at ``max_model_len``,
        or, with ``strict_max_tokens`` (the HTTP server, as vLLM does), is refused.
        """
        params = params or SamplingParams()
        params.validate()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}", "cache_salt")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty: give at least one token", "prompt")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    f"prompt holds a lone surrogate (U+{ord(prompt[e.start]):04X}) at index {e.start}, "
                    f"which is not valid Unicode text",
                    "prompt",
                ) from None
        elif not isinstance(prompt, (list, tuple)):
            raise RequestError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}", "prompt")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise RequestError("prompt is empty: give at least one token", "prompt")
        bad = [
            t for t in token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size)
        ]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        n, limit = len(token_ids), self.max_model_len
        if n > limit:
            raise RequestError(
                f"prompt has {n} tokens, more than max_model_len={limit}", "prompt", "context_length_exceeded"
            )
        if params.num_samples > self.config.max_num_seqs:
            field = "best_of" if params.best_of is not None else "n"
            raise RequestError(
                f"{field}={params.num_samples} samples exceed max_num_seqs={self.config.max_num_seqs}, "
                f"the sequences the engine runs at once",
                field,
            )
        if strict_max_tokens and params.max_tokens is not None and n + params.max_tokens > limit:
            raise RequestError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {n} tokens and max_model_len={limit}, "
                f"so max_tokens can be at most {limit - n}",
                "max_tokens",
                "context_length_exceeded",
            )
        total = limit if params.max_tokens is None else min(n + params.max_tokens, limit)
        need = cdiv(total, self.block_size)
        if need > self.pool.num_usable_blocks:
            raise RequestError(
                f"request needs {need} KV blocks ({total} tokens) but the cache has only "
                f"{self.pool.num_usable_blocks}; raise --kv-cache-memory/--num-blocks or lower max_tokens",
                "max_tokens" if cdiv(n, self.block_size) <= self.pool.num_usable_blocks else "prompt",
            )
        seq = Sequence(
            request_id,
            token_ids,
            params,
            self.block_size,
            prompt if isinstance(prompt, str) else None,
            arrival_time,
            cache_salt,
            self.config.prefix_caching_hash_algo,
            self._detokenizer(params),
        )
        self.requests[request_id] = ParallelRequest(seq)
        self.scheduler.add(seq)
        return request_id

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(*self._decoders[params.skip_special_tokens])

    def abort_request(self, request_id: str) -> bool:
        """Stop a waiting or running request (every sample) and free its blocks; ``False`` if unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        self._finish_all(req, SequenceStatus.FINISHED_ABORTED)
        self._update_gauges()
        return True

    def _finish_all(self, req: ParallelRequest, status: SequenceStatus) -> None:
        for seq in req.unfinished():
            self.scheduler.finish(seq, status)
        req.first.metrics.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and return outputs of requests that advanced.

        A failure is contained: a request whose sampling or output handling
        raises is aborted with an ``error`` (finish_reason ``abort``, every
        sample) and its blocks are freed, while the rest of the batch goes on;
        if the forward itself fails, every request of the step is aborted that way.
        """
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.num_alloc_failures = self.scheduler.num_alloc_failures
        if sched.empty:
            self._update_gauges()
            return []
        reqs = [self.requests[item.seq.request_id] for item in sched.scheduled]
        try:
            step = self.runner.execute(sched, self.block_size)
        except Exception as e:  # noqa: BLE001 - contained: the engine keeps serving
            logger.exception("the forward pass failed; aborting the %d requests of this step", len(reqs))
            failed = {r.request_id: r for r in reqs}
            outputs = [self._fail(r, f"the forward pass failed: {type(e).__name__}: {e}") for r in failed.values()]
            self._update_gauges()
            return outputs
        now = time.monotonic()
        advanced: dict[str, ParallelRequest] = {}
        for i, (item, req) in enumerate(zip(sched.scheduled, reqs)):
            if item.seq.finished:  # a sibling's failure earlier in this step aborted the request
                continue
            try:
                if self._advance(i, item, req, step, now):
                    advanced[req.request_id] = req
            except SamplingError as e:  # the sampler's own report: the reason is all there is to say
                logger.error("request %s failed; aborting it: %s", req.request_id, e)
                advanced[req.request_id] = self._failed(req, str(e))
            except Exception as e:  # noqa: BLE001
                logger.exception("request %s failed; aborting it", req.request_id)
                advanced[req.request_id] = self._failed(req, f"{type(e).__name__}: {e}")
        self.stats.num_steps += 1
        if self.offload is not None:  # the blocks this step completed, copied out before any can be reused
            self.offload.write_through()
        self._update_gauges()
        return [req.output() for req in advanced.values()]

    def _advance(self, i: int, item: ScheduledSeq, req: ParallelRequest, step: StepLogits, now: float) -> bool:
        """Account scheduled item ``i``'s forward and, if it sampled, its new token(s); True if it sampled."""
        seq = item.seq
        for _, first_row, positions in (r for r in step.inputs.prompt_rows if r[0] == i):
            rows = step.logits[first_row : first_row + len(positions)]
            nxt = seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            seq.prompt_logprobs.extend(
                position_logprobs(rows, nxt, [seq.params.prompt_logprobs] * len(nxt), self.token_text)
            )
        seq.num_computed_tokens += item.num_new_tokens
        self.kv_manager.cache_blocks(seq)
        if seq.num_computed_tokens <= seq.num_prompt_tokens:
            self.stats.prompt_tokens += item.num_new_tokens
        row = step.sample_row(i)
        if row is None:
            return False
        seqs = [seq]
        if seq.num_forks_pending:  # the prompt is prefilled: sample 0 forks into its siblings
            children = req.fork(seq, self.kv_manager, self._detokenizer)
            self.scheduler.add_forks(children)
            seqs += children
        rows = row.expand(len(seqs), -1)
        tokens = sample(rows, [s.params for s in seqs], [s.generator for s in seqs], [step.greedy_token(i)] * len(seqs))
        for token in tokens:
            if isinstance(token, Exception):  # the sampler's error for this row
                raise token
        logprobs = [None] * len(seqs)
        if seq.params.logprobs is not None or req.needs_cumulative_logprob:
            logprobs = position_logprobs(rows, tokens, [s.params.logprobs or 0 for s in seqs], self.token_text)
        for s, token, lp in zip(seqs, tokens, logprobs):
            s.append_token(token, lp)
            self.stats.generation_tokens += 1
            if s.metrics.first_token_time is None:
                s.metrics.first_token_time = now
            check_stop(s, self.eos_token_ids, self.max_model_len)
            if s.finished:
                self.scheduler.finish(s, s.status)
                s.metrics.finished_time = now
        if req.finished:
            self.requests.pop(req.request_id, None)
        return True

    def _fail(self, req: ParallelRequest, error: str) -> RequestOutput:
        """Abort every sample of ``req`` because the engine failed on it; its outputs carry ``error``."""
        return self._failed(req, error).output()

    def _failed(self, req: ParallelRequest, error: str) -> ParallelRequest:
        for seq in req.seqs:
            seq.error = error
        self._finish_all(req, SequenceStatus.FINISHED_ABORTED)
        self.requests.pop(req.request_id, None)
        return req

    def _update_gauges(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_usage = self.pool.usage()
        self.stats.prefix_cache_queries = self.kv_manager.prefix_queries
        self.stats.prefix_cache_hits = self.kv_manager.prefix_hits
