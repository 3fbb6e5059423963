"""What a tier entry is: the namespace of its key, and its bytes (one block of every layer).

The key of a block is ``sha256(namespace || block hash)`` (:class:`qkv.offload.KVOffload`). The block
hash is the SHA-256 chain over the whole prefix, with the request's ``cache_salt`` in the first block;
the namespace covers what else decides the bytes: the model (name, config and weight files), the model
dtype, the block size, every layer's cache dtype, shape and rotation, the bytes of every static scale,
and the entry format. Bytes are reused only where they would be recomputed identically up to batch
effects, exactly like the device prefix cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .kv_cache import KVCache

__all__ = ["CacheBlockIO", "namespace_digest", "ENTRY_FORMAT_VERSION"]

ENTRY_FORMAT_VERSION = 1  # the payload layout: per layer, the block's K/V rows then its dynamic scales
_EDGE = 1 << 20  # bytes hashed at each end of a weight file for the model identity


def _model_identity(model_path: Path) -> dict:
    """Name, config digest and weight files of a checkpoint directory.

    Each weight file counts with its size and the SHA-256 of its first and last MiB: hashing
    gigabytes at every start would cost seconds, while any retrained or requantized checkpoint
    differs in its header or first tensors.
    """
    config = model_path / "config.json"
    weights = []
    for f in sorted([*model_path.glob("*.safetensors"), *model_path.glob("*.bin")]):
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            fh.seek(max(0, size - _EDGE))
            h.update(fh.read(_EDGE))
        weights.append([f.name, size, h.hexdigest()])
    return {
        "name": model_path.name,
        "weights": weights,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
    }


def namespace_digest(model_path: Path, model_dtype: torch.dtype, cache: KVCache) -> bytes:
    """The engine-level part of every tier key: what, besides the tokens, decides a block's bytes."""
    material = {
        "entry_format": ENTRY_FORMAT_VERSION,
        "model": _model_identity(Path(model_path)),
        "model_dtype": str(model_dtype),
        "block_size": cache.block_size,
        "layers": [
            [s.layer_idx, s.num_kv_heads, s.head_dim, s.dtype.name, str(s.dtype.storage), s.rotation]
            for s in cache.specs
        ],
    }
    h = hashlib.sha256(json.dumps(material, sort_keys=True).encode())
    for layer in cache.layers:  # static scales, every byte (a recalibration changes the quantized bytes)
        for t in (layer.k_scale, layer.v_scale):
            h.update(_tensor_bytes(t))
        # a per-token cache's calibration (clipping ratios, key basis) decides its bytes as much; an uncalibrated
        # one hashes as before, so tiers written before these were hashed stay valid for it
        if layer.k_clip != 1.0 or layer.v_clip != 1.0 or layer.key_basis is not None:
            h.update(_tensor_bytes(torch.tensor([layer.k_clip, layer.v_clip])))
            basis = layer.key_basis
            for t in (None, None) if basis is None else (basis.mean, basis.smooth):
                h.update(_tensor_bytes(t))
    return h.digest()


def _tensor_bytes(t: torch.Tensor | None) -> bytes:
    raw = b"" if t is None else t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return len(raw).to_bytes(8, "big") + raw


class CacheBlockIO:
    """Whole blocks of every layer as bytes: each layer tensor seen as ``[num_blocks, bytes per block]``."""

    def __init__(self, cache: KVCache) -> None:
        self.views: list[torch.Tensor] = []
        for layer in cache.layers:
            for t in (layer.kv, layer.scale_cache):
                if t is not None:  # a uint8 view of the same memory, one row per block
                    self.views.append(t.view(torch.uint8).reshape(cache.num_blocks, -1))
        self.block_bytes = sum(v.shape[1] for v in self.views)
        self.device = self.views[0].device

    def gather(self, block_ids: list[int]) -> list[bytes]:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        rows = torch.cat([v.index_select(0, idx) for v in self.views], dim=1).cpu()
        return [r.numpy().tobytes() for r in rows]

    def scatter(self, block_ids: list[int], payloads: list[bytes]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        data = data.reshape(len(block_ids), self.block_bytes).to(self.device)
        col = 0
        for v in self.views:
            v.index_copy_(0, idx, data[:, col : col + v.shape[1]])
            col += v.shape[1]
