"""--batch-invariant: a request's tokens do not depend on what it is batched with.

The guarantee rests on two facts, both checked here on the machine that runs the tests:

* a fixed-shape GEMM call treats every row alike (row position and the other rows do not
  change a row's bits), so running every linear in ``TILE``-row calls makes it row-invariant;
* the CPU attention kernel computes every row with the same operations whatever the batch.

An fp8 cache makes this matter: a last-bit difference in K or V can cross an fp8 rounding
boundary and change a code, so without the flag an fp32 model with an fp8 cache gives some
requests other tokens inside a batch than alone (issue 15, point 8).
"""

import pytest
import torch
import torch.nn.functional as F

from qkv import LLM, SamplingParams
from qkv.batch_invariant import TILE, BatchInvariantLinear

pytestmark = pytest.mark.exactness

SHAPES = [(576, 1536), (1536, 576), (576, 192), (640, 2048)]  # SmolLM2 and Gemma 3 projections


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_fixed_shape_gemm_rows_do_not_depend_on_position_or_neighbours(dtype, threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for k, n in SHAPES:
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(TILE, k, generator=g).to(dtype)
            want = F.linear(x, w)
            for trial in range(4):
                perm = torch.randperm(TILE, generator=g)
                assert torch.equal(F.linear(x[perm], w), want[perm]), (k, n, "row order")
                other = torch.randn(TILE, k, generator=g).to(dtype)
                other[trial] = x[0]
                assert torch.equal(F.linear(other, w)[trial], want[0]), (k, n, "neighbours")
    finally:
        torch.set_num_threads(saved)


# Row counts of one call: decode (1-16), odd tails, a tile and a row past it, long prefill chunks.
CALL_ROWS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 375]  # 700 rows in all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mode_rows_do_not_depend_on_the_call_shape(dtype):
    """The property --batch-invariant promises: a row's bits are the same whether it is computed in a call of
    1, 17 or 700 rows, or inside a 3-D batch. Without the mode, oneDNN's bf16 kernels (AVX512-BF16, AMX) and
    the fp32 GEMMs change some rows' last bits with the row count; how many is printed, since it depends on
    the CPU, not asserted."""
    assert sum(CALL_ROWS) == 700
    g = torch.Generator().manual_seed(1)
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(700, k, generator=g).to(dtype)
        with BatchInvariantLinear():
            whole = F.linear(x, w)
            pieces = torch.cat([F.linear(part, w) for part in x.split(CALL_ROWS)])
            one_by_one = torch.cat([F.linear(row[None], w) for row in x[::7]])
            batched = F.linear(x.reshape(4, 175, k), w).reshape(700, n)
        assert torch.equal(pieces, whole), (k, n, "calls of other row counts")
        assert torch.equal(one_by_one, whole[::7]), (k, n, "one-row calls")
        assert torch.equal(batched, whole), (k, n, "a 3-D batch")
        plain = torch.cat([F.linear(part, w) for part in x.split(CALL_ROWS)])
        differ = int((plain != F.linear(x, w)).any(-1).sum())
        print(
            f"{dtype} [{k}->{n}]: without the mode {differ} of 700 rows differ between one call and "
            f"calls of {len(CALL_ROWS)} shapes on this CPU"
        )


def test_mode_pads_and_splits_rows():
    w = torch.randn(48, 16)
    x = torch.randn(2, 37, 16)
    with BatchInvariantLinear():
        y = F.linear(x, w)
    assert y.shape == (2, 37, 48)
    rows = x.reshape(-1, 16)
    tiles = torch.cat([rows, torch.zeros(-rows.shape[0] % TILE, 16)]).split(TILE)
    assert torch.equal(y.reshape(-1, 48), torch.cat([F.linear(t, w) for t in tiles])[:74])


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 2, 3, 5)] + [
    "An eight bit cache holds twice the tokens.",
    "Paged attention stores keys and values in blocks.",
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_outputs_alone_batched_chunked_and_cached_are_identical(tiny_dir, dtype):
    path = str(tiny_dir("gemma3"))  # sliding-window layers too
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # bfloat16 with the model's own GEMMs: oneDNN's bf16 kernels, whose blocking follows the call's shape on
    # CPUs with AVX512-BF16 or AMX, run in fixed tiles here like every other GEMM
    kw = dict(dtype=dtype, kv_cache_dtype="fp8", num_blocks=96, batch_invariant=True, cpu_matmul_dtype="model")
    alone = [LLM(path, **kw).generate([p], sp)[0].outputs[0].token_ids for p in PROMPTS]
    batched = LLM(path, **kw).generate(PROMPTS, sp)
    chunked = LLM(path, max_num_batched_tokens=7, **kw).generate(PROMPTS, sp)
    warm = LLM(path, **kw)
    warm.generate(PROMPTS[:3], sp)  # the next call hits the prefix cache on the shared prompts
    cached = warm.generate(PROMPTS, sp)
    assert sum(o.num_cached_tokens for o in cached) > 0
    for outs in (batched, chunked, cached):
        assert [o.outputs[0].token_ids for o in outs] == alone


@pytest.mark.slow
def test_smollm2_fp8_request_alone_equals_inside_a_batch():
    """Issue 15 point 8: fp32 model, fp8 cache, 16 requests alone and all at once."""
    from qkv.registry import resolve_model

    path = str(resolve_model("smollm2-135m"))
    topics = ["the ocean", "volcanoes", "castles", "bees", "the moon", "jazz", "chess", "rainforests"]
    prompts = [
        f"Tell me something interesting about {t}." + " Please be brief." * (i % 3) for i, t in enumerate(topics * 2)
    ]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    differ = {}
    for invariant in (True, False):
        llm = LLM(
            path,
            dtype="float32",
            kv_cache_dtype="fp8",
            kv_cache_memory="128MiB",
            batch_invariant=invariant,
            enable_prefix_caching=False,
        )
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        differ[invariant] = sum(a != b for a, b in zip(alone, together))
    print(
        f"requests whose tokens differ alone vs in a batch of 16: {differ[False]} without "
        f"--batch-invariant, {differ[True]} with it"
    )
    assert differ[True] == 0
