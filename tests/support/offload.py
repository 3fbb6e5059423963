"""Shared pieces of the offload-tier tests: a tiny model that takes a 2,048-token prefix, and the prompt.

The tiny llama of ``tiny_models`` stops at 1,024 positions; a copy with 4,096 (random weights, rope
needs no table) takes the issue's 2,048-token prefix while a prefill stays well under a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qkv.block_pool import BlockHash, hash_block_tokens

PREFIX = [(7 * i) % 370 + 3 for i in range(2048)]  # 128 full blocks of 16, inside the tiny vocabulary
PROMPT = PREFIX + [11, 12, 13, 14, 15]  # 2,053 tokens: the last 5 are always computed
NUM_PREFIX_BLOCKS = 128
BLOCK_BYTES_FP8 = 3 * 2 * 2 * 16 * 16  # layers x (K, V) x kv heads x head_dim x tokens = 3,072
# 140 blocks (139 usable) hold one 2,057-token sequence (129 blocks) and little else: a second
# prompt of the same length evicts the first one's prefix.
ENGINE = dict(dtype="float32", kv_cache_dtype="fp8", num_blocks=140, max_model_len=2100)
TIER_GIB = 0.0625  # 64 MiB: every block fits


def long_context_copy(tiny: Path, dest: Path) -> Path:
    """``tiny`` with ``max_position_embeddings`` 4,096, once per ``dest``."""
    if not (dest / "config.json").exists():
        shutil.copytree(tiny, dest)
        cfg = json.loads((dest / "config.json").read_text())
        cfg["max_position_embeddings"] = 4096
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def chain(tokens: list[int], salt: str | None = None, block_size: int = 16) -> list[BlockHash]:
    """The block hashes a request computes (``Sequence._update_block_hashes``), for full blocks."""
    out: list[BlockHash] = []
    for i in range(len(tokens) // block_size):
        extra = salt.encode() if salt is not None and i == 0 else b""
        out.append(hash_block_tokens(out[-1] if out else None, tokens[i * block_size : (i + 1) * block_size], extra))
    return out
