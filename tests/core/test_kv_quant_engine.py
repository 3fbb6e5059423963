"""The 8-bit cache end to end: backends agree, real models generate, capacity doubles, bad scales fail early."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qkv import LLM, SamplingParams
from qkv.scoring import prefill_logits

GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 3, 6)]


@pytest.mark.parametrize(
    "arch, kv",
    [
        ("llama", "fp8"),
        ("gemma3", "auto"),
        ("gemma3", "int8_per_token_head"),
        ("llama", "int4_per_token_head"),
        ("gemma3", "k8v4_per_token_head"),
    ],
)
def test_triton_backend_matches_torch_backend(tiny_dir, arch, kv):
    """Triton kernels under TRITON_INTERPRET=1 give the torch backend's greedy tokens.

    The second prompt is past gemma3's 24-token sliding window; prefill runs in
    chunks of 16 so the kernels also see prefill over a cached prefix.
    """
    path = str(tiny_dir(arch))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1][:120]]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path,
            dtype="float32",
            num_blocks=32,
            kv_cache_dtype=kv,
            attention_backend=backend,
            max_num_batched_tokens=16,
        )
        results = llm.generate(prompts, sp)
        assert len(results[1].prompt_token_ids) > 24
        outs[backend] = [o.outputs[0].token_ids for o in results]
        llm.llm_engine.pool.check_no_leaks()
    assert llm.llm_engine.backend.name == "triton"
    assert outs["triton"] == outs["torch"]


# ---------------------------------------------------------------- SmolLM2 --
@pytest.fixture(scope="module")
def smollm2():
    from qkv.registry import resolve_model

    return str(resolve_model("smollm2-135m"))


def minmax_scales(engine, texts, qmax):
    """Per-tensor absmax of the stored K and V over a few texts (a tiny calibration)."""
    amax: dict[tuple[int, str], float] = {}

    def observe(layer, k, v, q):
        for name, t in (("k", k), ("v", v)):
            amax[layer, name] = max(amax.get((layer, name), 0.0), t.float().abs().max().item())

    for text in texts:
        prefill_logits(engine, engine.tokenizer(text)["input_ids"][:512], observer=observe, keep_logits=False)
    n = len(engine.layer_specs)
    return {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor([amax[i, w] / qmax]) for i in range(n) for w in "kv"}


def teacher_forced(engine, seqs, prompt_lens):
    """Log-probabilities of the next token at every position that predicts a generated token."""
    out = []
    for ids, n in zip(seqs, prompt_lens):
        out.append(torch.log_softmax(prefill_logits(engine, ids)[n - 1 : -1], dim=-1))
    return torch.cat(out)


# (max mean KL, min top-1 agreement) for test_smollm2_quantized_modes_close_to_unquantized. Measured with
# OMP_NUM_THREADS=1 and =2 (identical to the digits shown), fp32 model, 8 prompts x 32 tokens:
#   fp8 0.0063 / 96.1%, int8 (minmax) 0.0040 / 97.3%, fp8_per_token_head 0.0037 / 96.9%,
#   int8_per_token_head 0.0007 / 99.2%, int8 with scales / 64: 8.09 / 1.2%; first tokens 8 of 8.
# Each bound is twice the measured KL and 3 points under the measured top-1: a machine's rounding
# moves these averages far less, a broken quantizer or wrong scales far more.
MODE_BOUNDS = {
    "fp8": (0.0126, 0.93),
    "int8": (0.008, 0.94),
    "fp8_per_token_head": (0.0074, 0.94),
    "int8_per_token_head": (0.0014, 0.96),
}


@pytest.mark.slow
@pytest.mark.exactness
def test_smollm2_quantized_modes_close_to_unquantized(smollm2, tmp_path):
    """Every 8-bit mode against the unquantized cache of the same fp32 model, teacher-forced on the
    unquantized run's greedy continuations: mean KL and top-1 agreement within bounds, not a snapshot
    of one CPU's rounding. Wrongly scaled int8 must fail the same bounds."""
    from support.prompts import PROMPTS as P8

    base = LLM(smollm2, dtype="float32", kv_cache_memory="256MiB")
    engine = base.llm_engine
    outs = base.generate(P8, GREEDY32)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    lens = [len(o.prompt_token_ids) for o in outs]
    ref = teacher_forced(engine, seqs, lens)
    scales = minmax_scales(engine, [P8[3] * 4, P8[7] * 3], 127.0)
    good = tmp_path / "int8_scales.safetensors"
    save_file(scales, str(good), metadata={"type": "int", "strategy": "tensor"})
    bad = tmp_path / "int8_scales_div64.safetensors"
    save_file({k: v / 64 for k, v in scales.items()}, str(bad), metadata={"type": "int", "strategy": "tensor"})
    measured = {}
    for kv, extra in [
        ("fp8", {}),
        ("int8", {"kv_scales": str(good)}),
        ("fp8_per_token_head", {}),
        ("int8_per_token_head", {}),
        ("int8/64", {"kv_scales": str(bad)}),
    ]:
        llm = LLM(
            smollm2,
            preloaded_model=engine.model,
            dtype="float32",
            kv_cache_memory="256MiB",
            kv_cache_dtype=kv.split("/")[0],
            **extra,
        )
        if kv == "int8":  # the engine really uses the file's scales
            assert torch.equal(
                llm.llm_engine.cache.layers[0].k_scale, scales["model.layers.0.self_attn.k_scale"].expand(3)
            )
        lp = teacher_forced(llm.llm_engine, seqs, lens)
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        first = sum(
            o.outputs[0].token_ids[0] == s[n]
            for o, s, n in zip(llm.generate(P8, SamplingParams(temperature=0, max_tokens=1)), seqs, lens)
        )
        measured[kv] = (round(kl, 4), round(top1, 3), first)
        llm.llm_engine.pool.check_no_leaks()
    print("mean KL, top-1 agreement, first tokens equal (of 8) vs the unquantized cache:", measured)
    for kv, (max_kl, min_top1) in MODE_BOUNDS.items():
        kl, top1, first = measured[kv]
        assert kl <= max_kl and top1 >= min_top1 and first >= 7, (kv, measured[kv])
    kl, top1, _ = measured["int8/64"]
    assert kl > 0.1 and top1 < 0.9, measured["int8/64"]


def test_capacity_doubles_at_1gib(smollm2):
    engines = {kv: LLM(smollm2, kv_cache_memory="1GiB", kv_cache_dtype=kv).llm_engine for kv in ("bfloat16", "fp8")}
    bf16, fp8 = engines["bfloat16"], engines["fp8"]
    print("SmolLM2 at 1 GiB:", bf16.capacity, "|", fp8.capacity)
    assert (bf16.cache.num_blocks, fp8.cache.num_blocks) == (2912, 5825)
    assert fp8.cache.num_blocks / bf16.cache.num_blocks >= 1.95
    # 2 x layers x kv_heads x head_dim x bytes
    assert bf16.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert fp8.kv_bytes_per_token == 2 * 30 * 3 * 64 * 1 == 11520
    dyn = LLM(smollm2, kv_cache_memory="1GiB", kv_cache_dtype="int8_per_token_head").llm_engine
    # dynamic scales count against the budget: 2 x 30 x 3 x (64 B + 4 B scale)
    assert dyn.kv_bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12240
    assert dyn.cache.num_blocks == (1 << 30) // (16 * 12240)


def test_4bit_capacity_at_1gib(smollm2):
    """int4: 30 layers x 3 heads x (32 + 32 B of codes + 8 B of fp32 scales) = 6,480 B/token, 3.55x bf16's
    blocks; k8v4 (64 + 32 + 8 B) = 9,360 B/token, 2.46x. The capacity line counts the scales."""
    blocks = {}
    for kv, per_token in (("bfloat16", 23040), ("int4_per_token_head", 6480), ("k8v4_per_token_head", 9360)):
        eng = LLM(smollm2, kv_cache_memory="1GiB", kv_cache_dtype=kv).llm_engine
        assert eng.kv_bytes_per_token == per_token
        assert eng.cache.num_blocks == (1 << 30) // (16 * per_token)
        assert f"{per_token:,} B/token" in eng.capacity
        blocks[kv] = eng.cache.num_blocks
    assert blocks["int4_per_token_head"] / blocks["bfloat16"] >= 3.5
    assert blocks["k8v4_per_token_head"] / blocks["bfloat16"] >= 2.4


# ---------------------------------------------------------------- Gemma 3 --
@pytest.mark.slow
def test_gemma3_fp8_skip_sliding_no_nan_on_reused_blocks():
    from qkv.registry import resolve_model

    path = str(resolve_model("gemma3-270m"))
    llm = LLM(
        path,
        dtype="float32",
        kv_cache_memory="128MiB",
        kv_cache_dtype="fp8",
        kv_cache_dtype_skip_layers="sliding_window",
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    # bytes per token by hand: 15 sliding layers stay bf16... in the model dtype (fp32 here) and
    # 3 full-attention layers are fp8; Gemma 3 270M has 1 kv head of head_dim 256.
    kinds = [s.dtype.name for s in engine.layer_specs]
    assert kinds == (["float32"] * 5 + ["fp8_e4m3"]) * 3
    assert engine.kv_bytes_per_token == 15 * (2 * 1 * 256 * 4) + 3 * (2 * 1 * 256 * 1)
    bf16 = LLM(
        path,
        dtype="bfloat16",
        kv_cache_memory="128MiB",
        kv_cache_dtype="fp8",
        kv_cache_dtype_skip_layers=["sliding_window"],
    ).llm_engine
    assert bf16.kv_bytes_per_token == 15 * (2 * 1 * 256 * 2) + 3 * (2 * 1 * 256 * 1) == 16896
    assert "fp8_e4m3 x3" in bf16.capacity and "bfloat16 x15" in bf16.capacity
    del bf16

    text = " ".join(
        f"Entry {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(120)
    )
    ids = engine.tokenizer(text)["input_ids"][:700]
    clean = llm.generate([ids], GREEDY32)[0].outputs[0].token_ids
    # Poison every block with bytes that decode to NaN (0x7F in e4m3, NaN in fp32), then reuse them.
    for layer in engine.cache.layers:
        if layer.kv.dtype == torch.float8_e4m3fn:
            layer.kv.view(torch.uint8).fill_(0x7F)
        else:
            layer.kv.fill_(float("nan"))
    assert torch.isnan(engine.cache.layers[5].kv.float()).all()
    again = llm.generate([ids], GREEDY32)[0].outputs[0].token_ids
    assert again == clean
    logits = prefill_logits(engine, ids[:600])
    assert torch.isfinite(logits).all()
    engine.pool.check_no_leaks()


# -------------------------------------------------------------- bad input --
@pytest.fixture(scope="module")
def tiny_llama(tiny_dir):
    return str(tiny_dir("llama"))  # 3 layers, 2 kv heads


def write_scales(path: Path, k, v, meta=None):
    tensors = {}
    for i, (ks, vs) in enumerate(zip(k, v)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs, dtype=torch.float32)
    save_file(tensors, str(path), metadata=meta)
    return str(path)


@pytest.mark.parametrize(
    "k, v, meta, kv, message",
    [
        ([[0.1]] * 2, [[0.1]] * 2, None, "fp8", r"cover layers .* but the model has 3 layers"),
        ([[0.1] * 4] * 3, [[0.1] * 4] * 3, None, "fp8", "has 4 values but the model has 2 kv heads"),
        (
            [[0.1], [float("nan")], [0.1]],
            [[0.1]] * 3,
            None,
            "fp8",
            "layer 1 k_scale .* is nan: scales must be finite and > 0",
        ),
        ([[0.1]] * 3, [[0.1], [0.1], [float("inf")]], None, "fp8", "layer 2 v_scale .* is inf"),
        ([[0.0]] * 3, [[0.1]] * 3, None, "fp8", "layer 0 k_scale .* is 0.0"),
        ([[0.1, -0.2]] * 3, [[0.1]] * 3, None, "fp8", "layer 0 k_scale .* is -0.2"),
        (
            [[0.1]] * 3,
            [[0.1]] * 3,
            {"type": "float", "strategy": "tensor"},
            "int8",
            "were calibrated for fp8 but --kv-cache-dtype is int8",
        ),
    ],
)
def test_bad_scales_rejected(tiny_llama, tmp_path, k, v, meta, kv, message):
    f = write_scales(tmp_path / "s.safetensors", k, v, meta)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, num_blocks=8, kv_cache_dtype=kv, kv_scales=f)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_cache_dtype="fp4"), "unknown kv-cache dtype 'fp4'; choose one of: auto, bfloat16, fp8"),
        (
            dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=[0, 3]),
            r"skip-layers index 3 is out of range: the model has 3 layers \(0..2\)",
        ),
        (dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="sliding_window"), "has no sliding-window layers"),
        (
            dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="every_other"),
            "takes 'sliding_window' or layer indices",
        ),
        (dict(kv_cache_dtype="int8"), "needs calibrated scales: run `qkv calibrate"),
    ],
)
def test_bad_cache_options_rejected(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, num_blocks=8, **kwargs)


def test_skip_layer_indices_and_per_head_scales(tiny_llama, tmp_path):
    f = write_scales(
        tmp_path / "h.safetensors", [[0.02, 0.03]] * 3, [[0.01, 0.04]] * 3, {"type": "int", "strategy": "head"}
    )
    llm = LLM(
        tiny_llama, dtype="bfloat16", num_blocks=16, kv_cache_dtype="int8", kv_scales=f, kv_cache_dtype_skip_layers=[1]
    )
    e = llm.llm_engine
    assert [s.dtype.name for s in e.layer_specs] == ["int8", "bfloat16", "int8"]
    assert torch.equal(e.cache.layers[2].k_scale, torch.tensor([0.02, 0.03]))
    assert e.cache.layers[1].k_scale is None
    assert e.kv_bytes_per_token_by_layer() == [2 * 2 * 16, 2 * 2 * 16 * 2, 2 * 2 * 16]
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    e.pool.check_no_leaks()
