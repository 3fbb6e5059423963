"""The fused CPU kernels (kernels/csrc/paged_cpu.cpp) against the torch reference.

* Cache writes are byte for byte the reference's, for every cache dtype, with rotation,
  per-channel scales and the values that stress rounding (ties, subnormals, saturation, NaN).
* 8-bit bytes decode exactly: all 256 codes of e4m3, e5m2 and int8 read back through attention.
* Attention agrees with the reference within 1e-5 (fp32) / bf16 rounding, with windows,
  GQA, rotation and per-channel scales.
* Rows are batch-invariant: a query row gives the same bits alone, in a batch, in any
  prefill chunking and at any thread count; stale NaN bytes are never read.
* With ``dense_prefill``, bf16 decode rows (csrc/paged_decode.h) and long chunks of bf16 queries
  (csrc/dense_prefill.h) run in bf16 products where the CPU has them: AMX tiles or, with AVX512-BF16 and no
  AMX, VDPBF16PS: the reference's attention to bf16 rounding.
"""

import logging
import os
from dataclasses import replace

import pytest
import torch
from support.paged import bits, paged_scenario, write_step

from qkv.attention import get_backend
from qkv.kernels.cpu_attention import CpuKernels
from qkv.kernels.cpu_build import KernelBuildError
from qkv.kernels.paged import PagedLayer, StepMetadata
from qkv.kernels.quant import STORAGE_DTYPES, resolve_cache_dtype
from qkv.kernels.reference import TorchReference
from qkv.registry import default_cache_dir

DTYPES = list(STORAGE_DTYPES)
BS = 16
ref = TorchReference()


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return CpuKernels.build(default_cache_dir() / "kernels")


def _special(dt) -> torch.Tensor:
    """Values of x / scale at rounding ties, grid points, subnormals and saturation, plus NaN/inf/-0."""
    extra = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 1e-30, -1e-30, 500.0, -500.0]
    if dt.kind == "int":
        return torch.cat(
            [
                torch.arange(-130, 130, dtype=torch.float32) + 0.5,
                torch.tensor(extra + [126.4, 126.6, 127.6, -127.6, 128.0, 0.49, 0.51]),
            ]
        )
    if dt.kind == "none":
        return torch.tensor(extra + [1.0 + 2**-8, 1.0 + 3 * 2**-9, 65504.0, 70000.0, 2**-24, 2**-25])
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt.storage).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties, subnormals included
    return torch.cat(
        [
            grid,
            -grid,
            mids,
            -mids,
            mids * (1 + 2**-20),
            mids * (1 - 2**-20),
            torch.tensor(extra + [dt.qmax * 1.0001, 464.0, 465.0]),
        ]
    )


def _kv_inputs(dt, tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = tokens * heads * dim
    rand = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 10, (n,), generator=g).float())
    x = torch.cat([_special(dt), rand])[:n]
    return x[torch.randperm(n, generator=g)].view(tokens, heads, dim).to(dtype)


def _static_scales(dt, heads: int, dim: int, channel: bool, seed: int):
    if not dt.quantized or dt.dynamic:
        return None, None
    g = torch.Generator().manual_seed(seed)
    shape = (heads, dim) if channel else (heads,)
    return torch.rand(shape, generator=g) * 0.5 + 0.25, torch.rand(shape, generator=g) * 0.5 + 0.25


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_write_bytes_equal_reference(kernels, name, rotate, in_dtype):
    dt = resolve_cache_dtype(name)
    heads, dim, blocks = 3, 64, 12
    for channel in (False, True) if dt.quantized and not dt.dynamic else (False,):
        key = _kv_inputs(dt, 100, heads, dim, in_dtype, 1)
        value = _kv_inputs(dt, 100, heads, dim, in_dtype, 2)
        ks, vs = _static_scales(dt, heads, dim, channel, 3)
        slots = torch.randperm((blocks - 1) * BS, generator=torch.Generator().manual_seed(4))[:100] + BS
        slots[[5, 17]] = -1  # padding tokens: nothing is written
        meta = write_step(slots)
        layers = []
        for backend in (ref, kernels):
            cache = torch.zeros(dt.cache_shape(blocks, BS, heads, dim), dtype=dt.storage)
            sc = torch.full((blocks, 2, BS, heads), 7.0) if dt.dynamic else None
            layer = PagedLayer(cache, dt, ks, vs, sc, rotate)
            backend.write(layer, key, value, meta)
            layers.append(layer)
        assert torch.equal(bits(layers[0].kv), bits(layers[1].kv)), f"{name} channel={channel}"
        if dt.dynamic:
            torch.testing.assert_close(layers[1].scale_cache, layers[0].scale_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("layout", ["rows strided", "heads strided"])
def test_write_accepts_strided_inputs(kernels, name, layout):
    """K and V arrive as views of the fused qkv projection: rows are strided, the last dim is not. A bf16 cache
    written from bf16 copies a token's heads in one run when they are contiguous, head by head when not."""
    dt = resolve_cache_dtype(name)
    fused = torch.randn(20, 2, 3, 64).to(torch.bfloat16 if name == "bfloat16" else torch.float32)
    kv = (fused[:, 0, :, :32], fused[:, 1, :, 32:]) if layout == "heads strided" else (fused[:, 0], fused[:, 1])
    dim = kv[0].shape[-1]
    meta = write_step(torch.arange(20) + BS)
    out = []
    for backend in (ref, kernels):
        layer = PagedLayer(
            torch.zeros(4, 2, BS, 3, dim, dtype=dt.storage), dt, torch.tensor([0.01]), torch.tensor([0.02])
        )
        backend.write(layer, *kv, meta)
        out.append(bits(layer.kv))
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0][1], torch.zeros_like(out[0][1]))  # block 1 holds the first 16 tokens


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("path", ["row loop, fp32 query", "bf16 products, bf16 query"])
def test_every_8bit_code_decodes_exactly(kernels, tiles, name, path):
    """One cached token whose V holds all 256 codes: attention over it returns V exactly (p = 1), through the row
    loop and through the bf16 decode products' widening to bf16 (AMX or VDPBF16PS, where the CPU has them; every
    fp8 and int8 value is a bf16)."""
    dt = resolve_cache_dtype(name)
    heads, dim = 4, 64
    cache = torch.zeros(2, 2, BS, heads, dim, dtype=torch.uint8)
    cache[1, 1, 0] = torch.arange(256, dtype=torch.uint8).view(heads, dim)
    one = torch.ones(heads)
    layer = PagedLayer(cache.view(dt.storage), dt, one, one)
    k, q_dtype = (kernels, torch.float32) if path.startswith("row") else (tiles[1], torch.bfloat16)
    query = torch.randn(1, heads, dim).to(q_dtype)
    out = k.attend(layer, query, StepMetadata.build([BS], [[1]], [1]), dim**-0.5)
    expected = torch.arange(256, dtype=torch.uint8).view(dt.storage).float().view(heads, dim)
    torch.testing.assert_close(out[0].float(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["int4_per_token_head", "k8v4_per_token_head"])
@pytest.mark.parametrize("path", ["row loop, fp32 query", "bf16 products, bf16 query"])
def test_every_packed_code_decodes_exactly(kernels, tiles, name, path):
    """One cached token of a packed 4-bit cache whose V holds all 16 int4 codes in both nibbles of its bytes
    (channel c = (c % 16) - 8; per-token scale 0.5): attention over it returns V exactly, through the row loop
    and through the bf16 products' nibble widening."""
    dt = resolve_cache_dtype(name)
    heads, dim = 2, 64
    cache = torch.zeros(2, dt.planes, BS, heads, dim // 2, dtype=torch.uint8)
    codes = (torch.arange(dim) % 16 - 8).repeat(heads, 1)
    low, high = codes[:, : dim // 2] & 0xF, codes[:, dim // 2 :] & 0xF
    cache[1, dt.side_planes(1)[0], 0] = (low | high << 4).to(torch.uint8)
    scales = torch.full((2, 2, BS, heads), float("nan"))
    scales[1, :, 0] = 0.5
    layer = PagedLayer(cache, dt, None, None, scales)
    k, q_dtype = (kernels, torch.float32) if path.startswith("row") else (tiles[1], torch.bfloat16)
    query = torch.randn(1, 2 * heads, dim).to(q_dtype)
    out = k.attend(layer, query, StepMetadata.build([BS], [[1]], [1]), dim**-0.5)
    expected = (0.5 * codes.float()).repeat_interleave(2, dim=0)
    torch.testing.assert_close(out[0].float(), expected, rtol=0, atol=0)


CASES = [
    (name, window, rotate, channel)
    for name in DTYPES
    for window in (None, 20)
    for rotate in (False, True)
    for channel in (False, True)
    if not (channel and (not resolve_cache_dtype(name).quantized or resolve_cache_dtype(name).dynamic))
]


def _mixed_step(name, window, rotate, channel, q_lens, seq_lens):
    """A step mixing decodes, short and long prefill chunks: 2 kv heads, 3 queries each, head_dim 32."""
    heads, group = 2, 3
    granularity = "channel" if channel else "head"
    return paged_scenario(
        name,
        seq_lens,
        q_lens,
        hq=heads * group,
        hkv=heads,
        d=32,
        granularity=granularity,
        rotate=rotate,
        window=window,
        block_size=BS,
    )


@pytest.mark.parametrize("name, window, rotate, channel", CASES)
def test_attention_matches_reference(kernels, name, window, rotate, channel):
    sc = _mixed_step(name, window, rotate, channel, q_lens=[1, 5, 40, 1, 33], seq_lens=[50, 5, 60, 17, 70])
    for qdt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q = sc.query.to(qdt)
        want = ref.attend(sc.layer, q, sc.meta, sc.sm_scale)
        got = kernels.attend(sc.layer, q, sc.meta, sc.sm_scale)
        assert got.dtype == qdt
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


@pytest.fixture(scope="module")
def dense() -> CpuKernels:
    return CpuKernels.build(default_cache_dir() / "kernels", dense_prefill=True)


@pytest.mark.parametrize("name, window, rotate, channel", CASES)
def test_dense_prefill_rows_equal_the_reference_bit_for_bit(kernels, dense, name, window, rotate, channel):
    """dense_prefill: chunks of >= DENSE_PREFILL_ROWS queries get their K/V dequantized by qkv_gather_kv, which
    equals the reference's dequantization exactly, then the reference's own SDPA call: the same bits. The
    other rows of the step (a decode, short chunks, a sequence without queries) stay on the fused kernel."""
    sc = _mixed_step(name, window, rotate, channel, q_lens=[1, 5, 40, 1, 33, 0], seq_lens=[50, 5, 60, 17, 70, 9])
    long_rows = torch.cat([torch.arange(6, 46), torch.arange(47, 80)])  # sequences 2 and 4
    chunk_rows, decode_rows = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 46])
    for qdt in (torch.float32, torch.bfloat16):
        q = sc.query.to(qdt)
        want = ref.attend(sc.layer, q, sc.meta, sc.sm_scale)
        got = dense.attend(sc.layer, q, sc.meta, sc.sm_scale)
        fused = kernels.attend(sc.layer, q, sc.meta, sc.sm_scale)
        assert got.dtype == qdt and bool(torch.isfinite(got).all())
        if dense.tiles_prefill(sc.layer.head_dim, qdt):  # bf16 products: within bf16 rounding of SDPA
            torch.testing.assert_close(got[long_rows].float(), want[long_rows].float(), rtol=0, atol=3e-2)
        else:
            assert torch.equal(bits(got[long_rows]), bits(want[long_rows]))
        assert torch.equal(bits(got[chunk_rows]), bits(fused[chunk_rows]))
        if _takes_tiles(dense, sc.layer, qdt):  # decode rows in bf16 products: within bf16 rounding of the reference
            torch.testing.assert_close(got[decode_rows].float(), want[decode_rows].float(), rtol=0, atol=3e-2)
        else:
            assert torch.equal(bits(got[decode_rows]), bits(fused[decode_rows]))


def _takes_tiles(k: CpuKernels, layer: PagedLayer, qdt: torch.dtype) -> bool:
    """Whether csrc/paged_decode.h computes this layer's bf16 decode rows in bf16 products (``decode::supports``)."""
    dt = layer.dt
    ok_dtype = dt.name in ("bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "fp8_per_token_head", "int8_per_token_head")
    ok_dtype |= dt.packed and layer.head_dim % 64 == 0  # whole 32-channel chunks per half row
    ok_shape = layer.head_dim % 32 == 0 and not layer.channel
    return k.dense_tiles is not None and qdt == torch.bfloat16 and ok_dtype and ok_shape


@pytest.fixture(scope="module", params=["amx", "avx512_bf16"])
def tiles(request) -> tuple[str, CpuKernels]:
    """Kernels whose decode rows and long prefill chunks of bf16 queries run on one kind of product, where the CPU
    has it (an AMX CPU runs both kinds; one with AVX512-BF16 only the second)."""
    return request.param, CpuKernels.build(
        default_cache_dir() / "kernels", dense_prefill=True, dense_tiles=request.param
    )


def _log_missing(kind: str, k: CpuKernels, what: str) -> None:
    if k.dense_tiles != kind:
        logging.getLogger("qkv").warning("this CPU (or build, or OS) has no %s: %s", kind, what)


DECODE_CASES = [
    (name, d, group, window, rotate)
    for name in DTYPES  # fp32 and fp16 caches too: the row loop computes them, bit for bit
    for d, group in ((64, 3), (128, 4), (32, 16), (64, 1), (256, 9))
    for window, rotate in ((None, False), (20, True))
]


@pytest.mark.parametrize("name, d, group, window, rotate", DECODE_CASES)
def test_decode_rows_in_bf16_products_match_the_reference(kernels, tiles, name, d, group, window, rotate):
    """Decode rows of bf16 queries in bf16 products (``dense_prefill``: AMX tiles or VDPBF16PS, where the CPU has
    them): the reference's attention to bf16 rounding, over partial blocks, windows, rotation, static and per-token
    scales, the packed 4-bit caches (their nibbles and split int8 half rows widened to bf16; head_dim % 64 == 0,
    else the row loop), every group size up to 16 (more than 8 query heads take VDPBF16PS two register groups)
    and head_dim up to 256. Where the CPU lacks the product the same rows run the row loop (and the log says
    so)."""
    kind, k = tiles
    _log_missing(kind, k, "decode rows run the row loop")
    seq_lens = [50, 5, 129, 17, 70, 16, 300]
    sc, got, want = _against_reference(k, name, seq_lens, [1] * len(seq_lens), group, d, window, rotate)
    assert got.dtype == torch.bfloat16
    taken = _takes_tiles(k, sc.layer, torch.bfloat16)
    codes = name not in ("float32", "float16") and (d % 64 == 0 or not sc.layer.dt.packed)  # codes that are bf16
    assert taken == (k.dense_tiles == kind and codes)
    if not taken:  # the row loop's bits
        assert torch.equal(bits(got), bits(kernels.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)))


def _against_reference(k: CpuKernels, name, seq_lens, q_lens, group, d, window, rotate):
    """bf16 queries of two kv heads: the kernels' attention and the reference's, which agree to bf16 rounding."""
    sc = paged_scenario(
        name, seq_lens, q_lens, hq=2 * group, hkv=2, d=d, rotate=rotate, window=window, q_dtype=torch.bfloat16, seed=3
    )
    want = ref.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    got = k.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=3e-2)
    return sc, got, want


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3", "int8", "int8_per_token_head", "int4_per_token_head"])
@pytest.mark.parametrize(
    "d, group, window, rotate", [(64, 3, None, False), (128, 2, 20, True), (64, 1, 100, False), (32, 4, None, False)]
)
def test_dense_prefill_tiles_match_the_reference(tiles, name, d, group, window, rotate):
    """Long prefill chunks of bf16 queries in bf16 products over the gathered K/V (csrc/dense_prefill.h: AMX tiles
    for head_dim % 64 == 0, VDPBF16PS for head_dim % 16 == 0, where the CPU has them): whole prompts and chunks with
    earlier context, causal and windowed, equal the reference's attention to bf16 rounding; where the product does
    not apply, SDPA computes them bit for bit (and the log says why)."""
    kind, k = tiles
    _log_missing(kind, k, "long chunks run torch's SDPA")
    _, got, want = _against_reference(k, name, [300, 70, 200, 33], [300, 40, 130, 33], group, d, window, rotate)
    taken = k.tiles_prefill(d, torch.bfloat16)
    assert taken == (k.dense_tiles == kind and d % {"amx": 64, "avx512_bf16": 16}[kind] == 0)
    if not taken:
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("name, nan", [("fp8_e4m3", 0x7F), ("bfloat16", 0xFF), ("int8_per_token_head", 0x7F)])
def test_decode_products_never_read_stale_bytes(tiles, name, nan):
    """NaN codes (NaN scales too, per token) in the slots past each sequence and before its window: the decode rows
    in bf16 products (or the row loop, where the CPU lacks them) do not change; bf16 K rows are read in place."""
    dense = tiles[1]
    seq_lens, window = [40, 75, 7], 24
    sc = paged_scenario(
        name, seq_lens, [1, 1, 1], hq=6, hkv=2, d=64, window=window, q_dtype=torch.bfloat16, stale=(nan, nan)
    )
    layer = sc.layer
    used = torch.zeros(layer.kv.shape[:3], dtype=torch.bool)
    for i, n in enumerate(seq_lens):
        for p in range(max(0, n - window), n):
            used[sc.tables[i, p // BS], :, p % BS] = True
    poisoned = layer.kv.clone().view(torch.uint8)
    poisoned[~used] = nan
    clean = poisoned.clone()
    clean[~used] = 0
    a = dense.attend(replace(layer, kv=clean.view(layer.dt.storage)), sc.query, sc.meta, 0.2)
    b = dense.attend(replace(layer, kv=poisoned.view(layer.dt.storage)), sc.query, sc.meta, 0.2)
    assert torch.isfinite(b).all() and torch.equal(a, b)


@pytest.mark.parametrize("name, channel", sorted({(name, channel) for name, _, _, channel in CASES}))
def test_gather_equals_the_reference_dequantization(dense, name, channel):
    sc = paged_scenario(
        name, [45, 70], [45, 3], hq=4, hkv=2, d=64, block_size=BS, granularity="channel" if channel else "head"
    )
    for out_dtype in (torch.float32, torch.bfloat16):
        for s, (n, start) in enumerate([(45, 0), (70, 19)]):
            k, v = ref_gather(sc, s, n, start, out_dtype)
            kv = dense.gather(sc.layer, sc.meta.block_tables[s], start, n, out_dtype)
            assert torch.equal(bits(kv[0]), bits(k)) and torch.equal(bits(kv[1]), bits(v))


def ref_gather(sc, s, n, start, out_dtype):
    from qkv.kernels.reference import gather_kv

    k, v = gather_kv(sc.layer, sc.meta.block_tables[s], n, out_dtype, start=start)
    return k.transpose(0, 1), v.transpose(0, 1)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_groups(kernels, group):
    sc = paged_scenario("int8_per_token_head", [37, 90], [3, 1], hq=2 * group, hkv=2, d=64, block_size=BS)
    assert sc.sm_scale == 0.125
    want = ref.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    got = kernels.attend(sc.layer, sc.query, sc.meta, sc.sm_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3", "int8_per_token_head"])
def test_rows_do_not_depend_on_batch_chunking_or_threads(kernels, name):
    """A sequence's output rows are bit-identical alone, inside a batch, split into prefill chunks
    of any size, and at 1 or 2 threads: every row runs the same operations in the same order."""
    heads, group, dim, window = 3, 3, 64, 48
    seq_lens = [70, 9, 130]
    sc = paged_scenario(
        name,
        seq_lens,
        seq_lens,
        hq=heads * group,
        hkv=heads,
        d=dim,
        window=window,
        block_size=BS,
        q_dtype=torch.bfloat16,
    )
    q = sc.query

    starts = [sum(seq_lens[:s]) for s in range(len(seq_lens))]

    def attend(chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        """One call over query chunks (sequence, first position, end position) as the engine would batch them."""
        query = torch.cat([q[starts[s] + a : starts[s] + b] for s, a, b in chunks])
        return kernels.attend(sc.layer, query, sc.step(chunks), sc.sm_scale)

    whole = attend([(s, 0, n) for s, n in enumerate(seq_lens)])
    calls = [[(2, 0, 7)], [(2, 7, 8)], [(2, 8, 100), (0, 0, 70)], [(1, 0, 9), (2, 100, 129)], [(2, 129, 130)]]
    for chunks in calls:  # prefill in uneven chunks, mixed with other sequences, then one decode row
        expected = torch.cat([whole[starts[s] + a : starts[s] + b] for s, a, b in chunks])
        assert torch.equal(attend(chunks), expected), chunks
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attend([(s, 0, n) for s, n in enumerate(seq_lens)]), whole)
    finally:
        torch.set_num_threads(threads)


def test_stale_nan_bytes_are_never_read(kernels):
    """Slots past a sequence's length and before its window hold NaN codes (0x7f): outputs do not change."""
    seq_lens, window = [40, 75], 24
    sc = paged_scenario(
        "fp8_e4m3", seq_lens, [1, 3], hq=4, hkv=2, d=32, window=window, block_size=BS, stale=(0x7F, 0x7F)
    )
    layer = sc.layer
    used = torch.zeros(layer.kv.shape[:3], dtype=torch.bool)
    for i, n in enumerate(seq_lens):
        for p in range(n):
            used[sc.tables[i, p // BS], :, p % BS] = True
    poisoned = layer.kv.clone().view(torch.uint8)
    assert bool((poisoned[~used] == 0x7F).all())
    clean = poisoned.clone()
    clean[~used] = 0
    first = sc.tables[1, 0]
    poisoned[first, :, :8] = 0x7F  # positions 0-7 of sequence 1 fall before every window below
    a = kernels.attend(replace(layer, kv=clean.view(layer.dt.storage)), sc.query, sc.meta, 0.2)
    b = kernels.attend(replace(layer, kv=poisoned.view(layer.dt.storage)), sc.query, sc.meta, 0.2)
    assert torch.isfinite(b).all() and torch.equal(a, b)


def test_bad_shapes_name_the_problem(kernels):
    """The CPU kernels' own limits are raised when a layer is prepared (and so by a first write); the layout's,
    when the layer is built; the query's, by attention."""
    dt = resolve_cache_dtype("fp8_e4m3")
    layer = PagedLayer(torch.zeros(4, 2, BS, 2, 12, dtype=dt.storage), dt, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"head_dim % 8 == 0"):
        kernels.prepare(layer)
    with pytest.raises(ValueError, match=r"head_dim % 8 == 0"):
        kernels.write(layer, torch.zeros(1, 2, 12), torch.zeros(1, 2, 12), write_step([16]))
    wide = PagedLayer(torch.zeros(4, 2, BS, 1, 520, dtype=torch.bfloat16), resolve_cache_dtype("bfloat16"))
    with pytest.raises(ValueError, match=r"head_dim <= 512 and block_size <= 64, got head_dim=520"):
        kernels.write(wide, torch.zeros(1, 1, 520), torch.zeros(1, 1, 520), write_step([16]))
    cache = torch.zeros(4, 2, BS, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match fp8_e4m3 storage"):
        PagedLayer(cache, dt, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"k_scale must have shape \[num_kv_heads=2\]"):
        PagedLayer(cache.to(dt.storage), dt, torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match=r"query must be \[T, Hq, 16\] with Hq a multiple of 2"):
        kernels.attend(
            PagedLayer(cache, resolve_cache_dtype("bfloat16")),
            torch.zeros(1, 3, 16),
            StepMetadata.build([0], torch.zeros(1, 1, dtype=torch.int32), [1]),
            0.25,
        )


def test_no_compiler_falls_back_to_reference_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="qkv"):
        backend = get_backend(None, torch.device("cpu"))
        get_backend(None, torch.device("cpu"))
    assert backend.name == "torch"
    warnings = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0]
    with pytest.raises(KernelBuildError, match="no C.. compiler found"):
        get_backend("cpu", torch.device("cpu"))


def test_march_override_builds_another_library(monkeypatch, tmp_path):
    """QKV_CPU_MARCH (what .ci/run's AVX2 rerun sets) replaces -march=native and names its own library."""
    from qkv.kernels.cpu_build import CXXFLAGS, build_library, cxxflags

    assert cxxflags() == CXXFLAGS or "QKV_CPU_MARCH" in os.environ
    monkeypatch.setenv("QKV_CPU_MARCH", "x86-64-v3")
    flags = cxxflags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags and len(flags) == len(CXXFLAGS)
    build_library.cache_clear()
    try:
        build_library(tmp_path)
        monkeypatch.delenv("QKV_CPU_MARCH")
        build_library.cache_clear()
        build_library(tmp_path)
    finally:
        build_library.cache_clear()
    assert len(list(tmp_path.glob("qkv_paged_cpu-*.so"))) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_hadamard_rows_equal_the_reference_bit_for_bit(kernels, dtype, d):
    """The dense prefill's rotation of a rotated cache's query and output: the C++ butterflies give
    ``hadamard_rotate(x).to(dtype)`` bit for bit, for strided inputs too and for values whose sums round."""
    from qkv.kernels.quant import hadamard_rotate

    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 37, d, generator=g) * torch.logspace(-6, 4, d)
    x[0, 0] = 1.0 + 2.0 ** -torch.arange(d).remainder(24)  # sums at the rounding boundaries of every dtype
    x[0, 1] = torch.full((d,), 2.0**-140)  # fp32 subnormals; bf16 flushes nothing, fp16 rounds them to zero
    x = x.to(dtype).transpose(0, 1)  # [37, 3, d], not contiguous: the launcher copies it
    got = kernels.hadamard(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(bits(got), bits(hadamard_rotate(x).to(dtype)))
