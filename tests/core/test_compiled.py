"""--compile-model: the decoder under torch.compile, attention and linears as opaque ops (qkv.compiled).

Compiling takes seconds even for a tiny model, so one compiled engine per architecture is shared by the tests.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.paged import bits

from qkv import LLM, SamplingParams
from qkv.config import EngineConfig
from qkv.kernels.paged import StepMetadata
from qkv.kernels.reference import TorchReference
from qkv.kv_cache import KVCache
from qkv.runner import StepInputs

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 3, 6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def compiled(request, tiny_dir):
    path = str(tiny_dir(request.param))
    before = graphs()
    llm = LLM(path, dtype="float32", num_blocks=64, kv_cache_dtype="int8_per_token_head", compile_model=True)
    return path, llm, graphs() - before


def test_one_graph_serves_every_batch(compiled):
    """Start-up compiles one graph (token count unbacked: 1 shares it); prefills, chunks and decodes of any
    batch size add none, and the engine keeps its blocks."""
    path, llm, at_start = compiled
    assert llm.llm_engine.runner.compiled is not None and at_start == 1
    before = graphs()
    llm.generate(PROMPTS, GREEDY)
    llm.generate(PROMPTS[:1], GREEDY)
    assert graphs() == before
    llm.llm_engine.pool.check_no_leaks()


def test_an_engine_sharing_the_model_reuses_its_graph(compiled):
    """A second engine on the same model object (as qkv bench and qkv eval make, one per cache dtype) compiles
    nothing: every function its forward installs (the RoPE copy, the linear modes) is the one the first installed,
    so dynamo's guards hold. One made per engine would recompile the decoder per engine, and leave each forward
    checking every other engine's guards first."""
    path, llm, _ = compiled
    model = llm.llm_engine.model
    before = graphs()
    other = LLM(path, preloaded_model=model, dtype="float32", num_blocks=64, kv_cache_dtype="fp8", compile_model=True)
    assert other.llm_engine.runner.compiled.ropes is llm.llm_engine.runner.compiled.ropes
    out = other.generate(PROMPTS[:1], GREEDY)
    assert graphs() == before and len(out[0].outputs[0].token_ids) == 24
    other.llm_engine.pool.check_no_leaks()


def test_same_tokens_as_eager(compiled):
    """fp32 tiny models: the compiled forward picks the eager forward's greedy tokens (gemma3: sliding
    window and final-logit soft-capping, applied by the eager LM head)."""
    path, llm, _ = compiled
    eager = LLM(path, dtype="float32", num_blocks=64, kv_cache_dtype="int8_per_token_head")
    assert eager.llm_engine.runner.compiled is None
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert ids == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [len(x) for x in ids] == [24, 24, 24]


def test_rope_tables_pass_through_the_opaque_copy_only_while_compiled(compiled):
    """The rotary embedding's cos and sin go through qkv::materialize inside the compiled forward (so that inductor
    computes them once, not in every layer), and the module's own forward is back once the step is done."""
    from qkv.compiled import materialize

    path, llm, _ = compiled
    ropes = llm.llm_engine.runner.compiled.ropes
    want = "Gemma3RotaryEmbedding" if "gemma3" in path else "LlamaRotaryEmbedding"
    assert [type(m).__name__ for m, _ in ropes] == [want]
    llm.generate(PROMPTS[:1], GREEDY)
    assert all("forward" not in m.__dict__ for m, _ in ropes)
    m, forward = ropes[0]
    args = (torch.randn(1, 5, 8), torch.arange(5)[None]) + (("sliding_attention",) if "gemma3" in path else ())
    assert all(torch.equal(a, b) for a, b in zip(forward(*args), m(*args)))  # the same tables, copied
    t = torch.randn(3, 4)
    assert torch.equal(materialize(t), t) and materialize(t).data_ptr() != t.data_ptr()


def test_cache_bytes_bit_exact_with_the_reference_write(compiled):
    """The compiled forward stores, through the engine's back end inside the opaque op, exactly the bytes the
    reference writes for the keys and values it hands over (an observer sees those)."""
    _, llm, _ = compiled
    eng = llm.llm_engine
    bs = eng.block_size
    blocks = [7, 3]  # any free blocks: nothing is running
    n = 2 * bs - 5
    slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
    inp = StepInputs(list(range(5, 5 + n)), list(range(n)), slots, [blocks], [n], [0, n], [n - 1])
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    eng.runner.forward(inp, observer=lambda i, k, v, q: seen.setdefault(i, (k.clone(), v.clone())))
    assert sorted(seen) == list(range(len(eng.cache.layers)))
    ref = KVCache(eng.layer_specs, eng.cache.num_blocks, bs)
    meta = StepMetadata.build(slots, [blocks], [n], [0, n])
    for i, (k, v) in seen.items():
        TorchReference().write(ref.layers[i], k, v, meta)
        got, want = eng.cache.layers[i], ref.layers[i]
        for t in (lambda c: c.kv, lambda c: c.scale_cache):  # [blocks, 2, block_size, ...]: the n slots written
            a = torch.stack([t(got)[s // bs, :, s % bs] for s in slots])
            assert torch.equal(bits(a), bits(torch.stack([t(want)[s // bs, :, s % bs] for s in slots]))), i


def test_compile_model_excludes_batch_invariant():
    with pytest.raises(ValueError, match="compile_model and batch_invariant exclude each other"):
        EngineConfig(model="x", compile_model=True, batch_invariant=True)


def test_machine_that_cannot_compile_falls_back_with_one_warning(tiny_dir, tmp_path):
    """No C++ compiler for inductor (``CXX`` names none, an empty inductor cache): one warning, eager, same
    tokens as an eager engine. In a subprocess, so that this process's compiler settings stay as they are."""
    script = textwrap.dedent(
        f"""
        import logging
        from qkv import LLM, SamplingParams
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        g = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        a = LLM({str(tiny_dir("llama"))!r}, dtype="float32", num_blocks=32, compile_model=True)
        b = LLM({str(tiny_dir("llama"))!r}, dtype="float32", num_blocks=32)
        same = a.generate(["a b c d"], g)[0].outputs[0].token_ids == b.generate(["a b c d"], g)[0].outputs[0].token_ids
        print("RESULT", a.llm_engine.runner.compiled is None, same)
        """
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT True True" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING qkv: --compile-model")]
    assert len(warnings) == 1 and "running eagerly" in warnings[0], out.stderr[-3000:]


def test_serve_with_compile_model(compiled):
    """``qkv serve --compile-model`` compiles before it reports healthy, and the official client's greedy
    completion is the text of an offline compiled engine run in a process with the server's environment (its
    thread count sets the GEMMs' blocking, and so a tiny random model's near-ties)."""
    import json

    import openai
    from support.server import ServerProcess, _env

    path, _, _ = compiled
    engine = {"dtype": "float32", "num_blocks": 64, "kv_cache_dtype": "int8_per_token_head", "compile_model": True}
    script = (
        "import json, sys\nfrom qkv import LLM, SamplingParams\n"
        f"llm = LLM({path!r}, dtype='float32', num_blocks=64, kv_cache_dtype='int8_per_token_head',\n"
        "          compile_model=True)\n"
        f"out = llm.generate([{PROMPTS[1]!r}], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]\n"
        "print(json.dumps(out.text))\n"
    )
    offline = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=600)
    assert offline.returncode == 0, offline.stderr[-3000:]
    srv = ServerProcess(model=path, engine=engine, api_key=None)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        r = client.completions.create(model=path, prompt=PROMPTS[1], max_tokens=12, temperature=0)
        assert r.choices[0].text == json.loads(offline.stdout.strip().splitlines()[-1])
        assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        assert "compiled the model in" in srv.log_tail()
    finally:
        srv.stop()
