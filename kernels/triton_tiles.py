"""Tile shapes and launch options of the paged-attention kernel, per head_dim, query dtype and GPU.

Kept apart from the kernel because they are a tuning decision with its own evidence:
``kernels/results/compile.json`` records registers, stack and spills of every
specialization the launchers make with these tiles, on sm_80, sm_89, sm_90 and sm_100.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

__all__ = ["Tiles", "attention_tiles"]


class Tiles(NamedTuple):
    """Tile shape and launch options of one attention specialization."""

    block_m: int  # rows per tile: (query token, query head of the group) pairs
    block_q: int  # query tokens per tile
    block_n: int  # keys per K/V tile
    num_warps: int
    num_stages: int
    q_chunk: int  # head_dim, or the chunk the QK dot reads the query in (fp32 at head_dim 256)


def attention_tiles(group: int, max_q_len: int, head_dim: int, q_bytes: int, arch: int | None) -> Tiles:
    """Tiles chosen so that no specialization spills registers on sm_80..sm_100.

    The compile check (``kernels/results/compile.json``) proves it for every launch the
    launchers make. What costs registers: the fp32 accumulator and query tile
    (``BLOCK_M x head_dim``), the dequantized K/V tiles (``BLOCK_N x head_dim``), the
    in-register Hadamard transform of the query and the output (a rotated cache), and fp32
    queries, whose three-pass TF32 dots split every operand in two. sm_80/sm_89 have no
    wgmma, so both dot operands live in registers there: they take smaller query tiles.
    head_dim 256 takes 16 x 16 tiles and 4 warps: with 8 warps ptxas caps the kernel at 128
    registers (two CTAs per SM) and spills a few bytes. fp32 takes small tiles and 8 warps;
    at head_dim 256 it reads the query in chunks of 64 inside the loop, because a whole
    ``16 x 256`` fp32 query tile split for TF32 needs more registers than a thread has.
    The interpreter (``arch=None``) uses the sm_90 tiles.
    """
    mma_v2 = arch is not None and arch < 90
    if q_bytes >= 4:
        max_rows, block_n, num_warps = 16, 16, (4 if head_dim <= 32 else 8)
    elif head_dim <= 64:
        max_rows, block_n, num_warps = 64, 32, 4
    elif head_dim <= 128:
        max_rows, block_n, num_warps = (32 if mma_v2 else 64), 32, 4
    else:
        max_rows, block_n, num_warps = 16, 16, 4
    if head_dim <= 32:  # tiny heads (tests): wide key tiles, few loop iterations
        block_n = 4096 // head_dim
    block_m = max(16, triton.next_power_of_2(group))
    while block_m < max_rows and block_m < group * max_q_len:
        block_m *= 2
    q_chunk = 64 if q_bytes >= 4 and head_dim > 128 else head_dim
    return Tiles(block_m, max(1, block_m // group), block_n, num_warps, 3, q_chunk)
