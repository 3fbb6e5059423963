"""Offline API shaped like ``vllm.LLM``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from .config import EngineConfig
from .engine import LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput

__all__ = ["LLM"]


class LLM:
    """``LLM(model, dtype="auto", kv_cache_dtype="auto", ...)``; keyword names follow vLLM's."""

    def __init__(self, model: str, preloaded_model=None, **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs), preloaded_model)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs come back in prompt order.

        A prompt is a string or a list of token ids. If any prompt is invalid,
        nothing is queued: every prompt is validated before the first runs.
        A request the engine fails on comes back aborted, with ``outputs[0].error``
        set; if the loop itself is interrupted (an exception, Ctrl-C), every
        request still running is aborted, so the engine is left clean.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for p, sp in zip(prompts, params):
                ids.append(engine.add_request(p, sp))
            while len(final) < len(ids):
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                if rid not in final:
                    engine.abort_request(rid)
            raise
        return [final[i] for i in ids]
