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
    "An eight bit cache holds twice the tokens.", "Paged attention stores keys and values in blocks."]


def test_tiny_outputs_alone_batched_chunked_and_cached_are_identical(tiny_dir):
    path = str(tiny_dir("gemma3"))  # sliding-window layers too
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="fp8", num_blocks=96, batch_invariant=True)
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
    prompts = [f"Tell me something interesting about {t}." + " Please be brief." * (i % 3)
               for i, t in enumerate(topics * 2)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    differ = {}
    for invariant in (True, False):
        llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="128MiB",
                  batch_invariant=invariant, enable_prefix_caching=False)
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        differ[invariant] = sum(a != b for a, b in zip(alone, together))
    print(f"requests whose tokens differ alone vs in a batch of 16: {differ[False]} without "
          f"--batch-invariant, {differ[True]} with it")
    assert differ[True] == 0
