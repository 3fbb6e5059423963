"""qkv: an inference engine with a paged FP8/INT8 KV cache.

``from qkv import LLM, SamplingParams`` is the offline API (shaped like vLLM's).
Heavy imports are lazy so that ``qkv.kernels`` and the CLI's ``--help`` stay fast.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    if name == "LLMEngine":
        from .engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
