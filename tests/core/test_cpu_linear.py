"""cpu_matmul_dtype: a bf16 model's linears multiplied in fp32 (qkv/cpu_linear.py).

The fp32 path must be exactly "upcast, fp32 GEMM, one rounding back" (bit-exact against that
formula), leave the model untouched outside a forward, and keep small calls on the model's 16-bit
weights (the few-row kernel, qkv/small_linear.py). On a real model, qkv with it gives the tokens of
transformers.generate running the same arithmetic (the same mode around the transformers model), so that
nothing is lost but the summation order inside a GEMM.
"""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

from qkv import LLM, SamplingParams
from qkv.batch_invariant import BatchInvariantLinear
from qkv.config import EngineConfig
from qkv.cpu_linear import (
    MIN_ROWS,
    Fp32Linear,
    PackedLinear,
    linear_modes,
    native_16bit_matmul,
    onednn_available,
    resolve_cpu_matmul,
)
from qkv.small_linear import KernelLinear, few_rows_kernel

CPU = torch.device("cpu")


def bf16_packing_or_log(lin: torch.nn.Module) -> bool:
    """Whether oneDNN can pack bf16 weights on this CPU. Where it cannot (AVX2 only), the engine never picks the
    packed mode (resolve_cpu_matmul); this checks that packing then fails loudly and says so in the log."""
    if onednn_available(torch.bfloat16):
        return True
    with pytest.raises(RuntimeError, match="bf16"):
        PackedLinear(lin)
    print("this CPU lacks the ISA oneDNN needs to pack bf16 weights (AVX-512 or AVX-NE-CONVERT): packed mode not run")
    return False


def _few_rows_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What a few-row call must give: the kernel's result where this machine builds it (AVX2, a compiler), else
    torch's own 16-bit GEMM, the documented fallback (logged, so a run says which one it checked)."""
    kernel = few_rows_kernel()
    if kernel is None:
        logging.getLogger("qkv").warning("test: no few-row kernel on this machine; checking torch's GEMM fallback")
        return F.linear(x, w, b)
    return kernel(x, w, b)


def _linear(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    return torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, b, "none", [], "")


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_path_is_the_upcast_formula_bit_for_bit_and_small_calls_stay_native(bias, onednn):
    lin = _linear(bias)
    model = torch.nn.Sequential(lin)
    x = torch.randn(3, MIN_ROWS, 96).to(torch.bfloat16)
    few = torch.randn(MIN_ROWS - 1, 96).to(torch.bfloat16)
    b32 = None if lin.bias is None else lin.bias.float()
    # without autograd, as the engine runs: a call that needs gradients takes torch's GEMM instead of the kernel
    with torch.no_grad(), Fp32Linear(model, onednn=onednn):
        y, y_few = model(x), model(few)
    assert y.dtype == torch.bfloat16 and y.shape == (3, MIN_ROWS, 160)
    if onednn:  # oneDNN's inner product on the reordered weight, rounded once
        want = _onednn_linear(x.float(), lin.weight.float(), b32).reshape(3, MIN_ROWS, 160)
    else:
        want = F.linear(x.float(), lin.weight.float(), b32)
    assert torch.equal(y, want.to(torch.bfloat16))
    # either way an fp32 accumulation of the exact products: within fp32 rounding of the float64 result
    exact = F.linear(x.double(), lin.weight.double(), None if b32 is None else b32.double())
    assert (want.double() - exact).abs().max().item() < 1e-5
    # fewer rows: the 16-bit weights through the few-row kernel (tests/kernels/test_cpu_gemm.py), not fp32 copies
    assert torch.equal(y_few, _few_rows_reference(few, lin.weight, lin.bias))
    # outside the mode the module is the plain nn.Linear again
    assert "forward" not in lin.__dict__
    assert torch.equal(model(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("bias", [True, False])
def test_compiled_fp32_path_takes_the_eager_paths_branch_at_run_time(bias):
    """Under torch.compile the row count is a symbol, so the branch lives in the opaque ``qkv::fp32_linear``: one
    compiled graph (dynamic rows) gives a one-row call the few-row kernel on the bf16 weights and a call of
    ``MIN_ROWS`` rows the upcast formula, each bit for bit what the eager mode computes."""
    lin = _linear(bias)
    mode = Fp32Linear(lin, onednn=True)
    forward = torch.compile(lambda x: lin(x), dynamic=True, fullgraph=True)
    one, many = torch.randn(1, 96).to(torch.bfloat16), torch.randn(MIN_ROWS + 2, 96).to(torch.bfloat16)
    with mode, torch.no_grad():  # the engine's forwards run without autograd, as here
        eager_one, eager_many = lin(one), lin(many)
        compiled_one, compiled_many = forward(one), forward(many)
    assert torch.equal(compiled_one, _few_rows_reference(one, lin.weight, lin.bias))
    assert torch.equal(compiled_one, eager_one)
    b32 = None if lin.bias is None else lin.bias.float()
    want = _onednn_linear(many.float(), lin.weight.float(), b32).to(torch.bfloat16)
    assert torch.equal(compiled_many, want) and torch.equal(compiled_many, eager_many)


def test_min_rows_one_takes_fp32_for_every_call():
    lin = _linear(True)
    x = torch.randn(1, 96).to(torch.bfloat16)
    with Fp32Linear(lin, min_rows=1, onednn=False):
        y = lin(x)
    assert torch.equal(y, F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16))


def test_tied_weights_are_converted_once_and_fp32_models_not_at_all():
    emb = torch.nn.Embedding(50, 96).to(torch.bfloat16)
    head = torch.nn.Linear(96, 50, bias=False).to(torch.bfloat16)
    head.weight = emb.weight  # tied, as SmolLM2's LM head is
    other = torch.nn.Linear(96, 50, bias=False).to(torch.bfloat16)
    modules = torch.nn.ModuleList([emb, head, other, torch.nn.Linear(4, 4)])  # the fp32 one is left alone
    dense, onednn = Fp32Linear(modules, onednn=False), Fp32Linear(modules, onednn=True)
    assert [m for m, _, _ in dense.linears] == [m for m, _, _ in onednn.linears] == [head, other]
    assert dense.linears[0][1].dtype == torch.float32
    assert torch.equal(dense.linears[0][1], emb.weight.float())
    assert onednn.linears[0][1].is_mkldnn and torch.equal(onednn.linears[0][1].to_dense(), emb.weight.float())


def test_onednn_is_found_in_this_torch_build():
    # The pinned CPU wheel has oneDNN; the default takes it (a build without it would take F.linear).
    assert onednn_available() is True
    assert Fp32Linear(_linear(False)).onednn is True


def test_engines_sharing_a_model_share_one_set_of_fp32_copies(tiny_dir):
    kw = dict(dtype="bfloat16", cpu_matmul_dtype="float32", num_blocks=16)
    a = LLM(str(tiny_dir("llama")), **kw).llm_engine
    b = LLM(str(tiny_dir("llama")), preloaded_model=a.model, batch_invariant=True, **kw).llm_engine
    c = LLM(str(tiny_dir("llama")), preloaded_model=a.model, **kw).llm_engine
    mode_a, mode_b, mode_c = (e.runner.linear_modes[0]() for e in (a, b, c))
    assert (mode_a.min_rows, mode_c.min_rows) == (MIN_ROWS, MIN_ROWS)
    assert (mode_a.onednn, mode_c.onednn) == (True, True)
    assert mode_a.linears is mode_c.linears and len(mode_a.linears) > 0
    # the batch-invariant engine multiplies the 16-bit weights themselves (the few-row kernel at every row
    # count), so it adds no copies: the model holds oneDNN's, made once for a and c
    assert isinstance(mode_b, KernelLinear) and mode_b.linears == [m for m, _, _ in mode_a.linears]
    assert [k for k in a.model.__dict__["_qkv_fp32_linears"] if not isinstance(k, tuple)] == [True]


def test_resolve_cpu_matmul_explicit_settings():
    assert resolve_cpu_matmul("float32", torch.bfloat16, CPU) == "float32"
    assert resolve_cpu_matmul("float32", torch.float16, CPU) == "float32"
    assert resolve_cpu_matmul("model", torch.bfloat16, CPU) == "model"
    assert resolve_cpu_matmul("float32", torch.float32, CPU) == "model"  # nothing to upcast
    assert resolve_cpu_matmul("float32", torch.bfloat16, torch.device("cuda")) == "model"  # GPUs have bf16 units
    with pytest.raises(ValueError, match="cpu_matmul_dtype must be one of auto, model, float32"):
        resolve_cpu_matmul("fp64", torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="cpu_matmul_dtype must be one of auto, model, float32; got 'fp16'"):
        EngineConfig(model="smollm2-135m", cpu_matmul_dtype="fp16")


def test_resolve_cpu_matmul_auto_follows_the_cpu(monkeypatch):
    """auto: fp32 upcasts without 16-bit matrix units, packed 16-bit GEMMs with them (where oneDNN is built in)."""
    import qkv.cpu_linear as cl

    monkeypatch.setattr(cl, "native_16bit_matmul", lambda dtype: False)
    assert resolve_cpu_matmul("auto", torch.bfloat16, CPU) == "float32"
    monkeypatch.setattr(cl, "native_16bit_matmul", lambda dtype: True)
    packs = onednn_available(torch.bfloat16)
    assert resolve_cpu_matmul("auto", torch.bfloat16, CPU) == ("packed" if packs else "model")
    assert resolve_cpu_matmul("auto", torch.float32, CPU) == "model"


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_16bit_matmul_means_onednn_can_pack_that_dtype(dtype):
    """Where the CPU has bf16 units but oneDNN is capped below them (ONEDNN_MAX_CPU_ISA=AVX2, as the exactness
    rerun runs), auto must not pick the packed path: its weight reorder would raise. Run under both ISAs by CI."""
    if native_16bit_matmul(dtype):
        assert onednn_available(dtype) is True
        assert resolve_cpu_matmul("auto", dtype, CPU) == "packed"
    else:
        assert resolve_cpu_matmul("auto", dtype, CPU) == "float32"


def test_batch_invariant_mode_sits_on_top_and_the_kernel_or_fp32_takes_every_call():
    lin = _linear(False)
    modes = linear_modes(lin, "float32", batch_invariant=True)
    assert len(modes) == 2 and modes[1] is BatchInvariantLinear
    first = modes[0]()
    assert modes[0]() is first  # built once, entered every forward
    if few_rows_kernel() is not None:
        assert isinstance(first, KernelLinear)
    else:
        logging.getLogger("qkv").warning("test: no few-row kernel on this machine; checking the fp32 fallback")
        assert isinstance(first, Fp32Linear) and first.min_rows == 1 and first.onednn is False
    assert linear_modes(lin, "model", batch_invariant=False) == []
    assert linear_modes(lin, "model", batch_invariant=True) == [BatchInvariantLinear]  # bf16 GEMMs in the tiles
    assert linear_modes(lin, "float32", batch_invariant=False)[0]().min_rows == MIN_ROWS
    # the packed mode is a speed path: under the fixed-shape tiles, plain F.linear in the model's dtype
    assert [type(m()).__name__ for m in linear_modes(lin, "packed", batch_invariant=True)] == ["BatchInvariantLinear"]
    if bf16_packing_or_log(lin):
        assert isinstance(linear_modes(lin, "packed", batch_invariant=False)[-1](), PackedLinear)


# Row counts of one call: decode (1-16), odd tails, the split size and a row past it, long prefill chunks.
CALL_ROWS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 47, 48, 49, 100, 360]  # 700 rows in all


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_mode_rows_do_not_depend_on_the_call_shape(bias, dtype):
    """--batch-invariant's promise on the kernel path: a row's bits are the kernel's, whether computed in a call of
    1, 49 or 700 rows (split into calls of at most TILE) or inside a 3-D batch, with no padding."""
    kernel = few_rows_kernel()
    assert kernel is not None, "every x86 machine this project runs on has AVX2, FMA and F16C"
    lin = _linear(bias).to(dtype)
    x = torch.randn(700, 96).to(dtype)
    assert sum(CALL_ROWS) == 700
    matmul = "float32" if dtype == torch.bfloat16 else "model"  # what resolve_cpu_matmul gives an AVX2 CPU
    mode = linear_modes(lin, matmul, batch_invariant=True)[0]()
    assert isinstance(mode, KernelLinear) and mode.linears == [lin]
    with mode:
        whole = lin(x)
        pieces = torch.cat([lin(part) for part in x.split(CALL_ROWS)])
        batched = lin(x.reshape(4, 175, 96)).reshape(700, 160)
        with pytest.raises(TypeError, match=rf"{dtype} inputs without grad expected, got torch.float16"):
            lin(x.half())
    assert torch.equal(whole, kernel(x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach()))
    assert torch.equal(pieces, whole) and torch.equal(batched, whole)
    assert "forward" not in lin.__dict__  # restored on exit


@pytest.mark.parametrize("rows", [1, 3, 16, 50])
def test_packed_linear_is_onednns_inner_product_in_the_models_dtype(rows):
    lin = _linear(True)
    if not bf16_packing_or_log(lin):
        pytest.skip("this CPU lacks the ISA oneDNN needs to pack bf16 weights (the one hardware exception)")
    x = torch.randn(2, rows, 96).to(torch.bfloat16)
    with PackedLinear(lin):
        y = lin(x)
    w = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 16)
    want = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, 96), w, lin.bias.detach(), "none", [], "")
    assert y.dtype == torch.bfloat16 and y.shape == (2, rows, 160)
    assert torch.equal(y.reshape(-1, 160), want)
    # the same product as F.linear's, to bf16 rounding
    torch.testing.assert_close(
        y.float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()), rtol=2e-2, atol=2e-2
    )
    assert "forward" not in lin.__dict__  # restored on exit


def test_tiny_bf16_model_with_fp32_matmul_is_batch_invariant(tiny_dir):
    prompts = ["a b c d e f g h i j k l", "m n o", "p q r s t u v w x y z a b c d e f g h", "b c"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="bfloat16", cpu_matmul_dtype="float32", kv_cache_dtype="fp8", num_blocks=96, batch_invariant=True)
    alone = [LLM(str(tiny_dir("llama")), **kw).generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    batched = LLM(str(tiny_dir("llama")), **kw).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in batched] == alone


@pytest.mark.slow
@pytest.mark.exactness
def test_smollm2_bf16_fp32_matmul_matches_transformers_with_the_same_arithmetic():
    """The fp32 arithmetic of a bf16 model's linears (exact products, fp32 sums, one rounding), in the shape-invariant
    mode on both sides: qkv's --batch-invariant (the few-row kernel at every row count) and transformers under
    the same modes. bf16 identity with transformers is asserted only under such a mode: outside it the GEMMs'
    bits follow the call's shape (tests/core/test_real_models.py)."""
    from transformers import AutoModelForCausalLM

    from qkv.registry import resolve_model

    path = str(resolve_model("smollm2-135m"))
    llm = LLM(
        path,
        dtype="bfloat16",
        cpu_matmul_dtype="float32",
        kv_cache_memory="256MiB",
        attention_backend="torch",
        batch_invariant=True,
    )
    tok = llm.get_tokenizer()
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
        "List three facts about the Moon:",
    ]
    sp = SamplingParams(temperature=0, max_tokens=48)
    got = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    eos = tok.eos_token_id
    with contextlib.ExitStack() as stack:
        for make in linear_modes(model, "float32", batch_invariant=True):
            stack.enter_context(make())
        for p, ids in zip(prompts, got):
            t = tok(p, return_tensors="pt").input_ids
            ref = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=48, do_sample=False)
            ref = ref[0, t.shape[1] :].tolist()
            assert ids == (ref[: ref.index(eos) + 1] if eos in ref else ref)
    assert "Paris" in tok.decode(got[0])
