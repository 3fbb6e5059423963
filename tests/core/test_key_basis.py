"""The key basis of the calibrated 4-bit caches (qkv.key_basis): its arithmetic, its place in the engine (the
cache stores exactly what the reference writes for the transformed keys), and checkpoints that carry a bad one."""

import math

import pytest
import torch
from safetensors.torch import save_file
from support.paged import bits

from qkv import LLM
from qkv.kernels.paged import StepMetadata
from qkv.kernels.reference import TorchReference
from qkv.key_basis import SMOOTHING_POWER, KeyBasis, KeyStats, smoothing_factors
from qkv.kv_cache import KVCache
from qkv.runner import StepInputs

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HKV, D = 3, 2, 16  # tests/support/tiny_models.py's llama


def test_smoothing_factors_follow_the_rms_ratio_per_channel():
    """rms(K - mu) / rms(Q) = [1, 4, 1, 2] at power 1/2 is [1, 2, 1, 2^0.5], over its geometric mean 2^(3/8)."""
    s = smoothing_factors(torch.tensor([[1.0, 16.0, 4.0, 4.0]]), torch.tensor([[1.0, 1.0, 4.0, 1.0]]), 0.5)
    want = torch.tensor([[2**-0.375, 2**0.625, 2**-0.375, 2**0.125]])
    assert torch.allclose(s, want, rtol=1e-6, atol=0) and s.dtype == torch.float32
    assert torch.equal(smoothing_factors(torch.rand(2, 8) + 0.1, torch.rand(2, 8) + 0.1, 0.0), torch.ones(2, 8))
    assert SMOOTHING_POWER == 0.25


def test_key_stats_take_the_mean_and_the_group_mean_of_q_squared():
    """Two tokens, one kv head serving two query heads: mu is K's mean, the variance is about it, and Q's mean
    square is over the tokens and the group's heads."""
    st = KeyStats()
    k = torch.tensor([[[1.0, 10.0]], [[3.0, 10.0]]])  # [T=2, Hkv=1, D=2]: channel 1 is a pure offset
    q = torch.tensor([[[1.0, 2.0], [3.0, 2.0]], [[1.0, 2.0], [3.0, 2.0]]])  # [T=2, H=2, D=2]
    st.update(q, k)
    b = st.basis(0.5)
    assert torch.equal(b.mean, torch.tensor([[2.0, 10.0]]))
    # k_var [1, 0 -> 1e-12], q_sq [5, 4]: ratios sqrt(1/5), sqrt(1e-12/4)
    r = torch.tensor([math.sqrt(math.sqrt(1 / 5)), math.sqrt(math.sqrt(1e-12 / 4))], dtype=torch.float64)
    assert torch.allclose(b.smooth, (r / r.log().mean().exp()).float()[None], rtol=1e-6)


def test_basis_leaves_every_softmax_row_unchanged():
    """(K - mu) / s with Q s: every score of a query moves by the same q . mu, so the attention weights stay."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, D, generator=g), torch.randn(7, HKV, D, generator=g) * 3 + 5
    basis = KeyBasis(torch.randn(HKV, D, generator=g), torch.rand(HKV, D, generator=g) + 0.5)

    def weights(q, k):
        return torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, 1)).softmax(-1)

    assert torch.allclose(weights(basis.queries(q), basis.keys(k)), weights(q, k), atol=1e-5, rtol=0)
    assert not torch.allclose(basis.keys(k), k)


@pytest.mark.parametrize(
    "mean, smooth, match",
    [
        (torch.zeros(2, 16), torch.ones(2, 8), "must both be \\[Hkv, D\\]"),
        (torch.zeros(2, 16), torch.zeros(2, 16), "finite and positive"),
        (torch.full((2, 16), float("nan")), torch.ones(2, 16), "finite and positive"),
    ],
)
def test_basis_rejects_bad_tensors(mean, smooth, match):
    with pytest.raises(ValueError, match=match):
        KeyBasis(mean, smooth)


def _bases(seed: int = 1) -> dict[int, KeyBasis]:
    g = torch.Generator().manual_seed(seed)
    return {i: KeyBasis(torch.randn(HKV, D, generator=g), torch.rand(HKV, D, generator=g) + 0.5) for i in range(LAYERS)}


def _forward(eng, observer) -> tuple:
    bs = eng.block_size
    blocks, n = [5, 2], 2 * eng.block_size - 3
    slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
    inp = StepInputs(list(range(3, 3 + n)), list(range(n)), slots, [blocks], [n], [0, n], [n - 1])
    return eng.runner.forward(inp, observer=observer), slots, blocks, n


def test_engine_stores_the_reference_bytes_of_the_transformed_keys(tiny_dir):
    """int4 with a basis on every layer: the first layer's keys reach the cache as ``basis.keys(k)`` of the keys
    the model made (bit for bit), and every layer's cache holds exactly the bytes the reference writes for the
    keys and values it was handed."""
    eng = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_dtype="int4_per_token_head", num_blocks=16).llm_engine
    raw: dict[int, torch.Tensor] = {}
    _forward(eng, lambda i, k, v, q: raw.setdefault(i, k.clone()))
    bases = _bases()
    eng.replace_kv_cache(eng.layer_specs, bases=bases)
    assert all(
        torch.equal(layer.key_basis.mean, bases[i].mean) and torch.equal(layer.key_basis.smooth, bases[i].smooth)
        for i, layer in enumerate(eng.cache.layers)
    )
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    _, slots, blocks, n = _forward(eng, lambda i, k, v, q: seen.setdefault(i, (k.clone(), v.clone())))
    assert torch.equal(seen[0][0], bases[0].keys(raw[0]))
    bs = eng.block_size
    ref = KVCache(eng.layer_specs, eng.cache.num_blocks, bs)
    meta = StepMetadata.build(slots, [blocks], [n], [0, n])
    for i, (k, v) in seen.items():
        TorchReference().write(ref.layers[i], k, v, meta)
        got, want = eng.cache.layers[i], ref.layers[i]
        for t in (lambda c: c.kv, lambda c: c.scale_cache):
            a = torch.stack([t(got)[s // bs, :, s % bs] for s in slots])
            assert torch.equal(bits(a), bits(torch.stack([t(want)[s // bs, :, s % bs] for s in slots]))), i


def test_an_unquantized_cache_with_a_basis_gives_the_same_logits(tiny_dir):
    """The basis changes roundings only: on a float32 cache the logits agree with the plain engine's."""
    eng = LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=16).llm_engine
    plain, *_ = _forward(eng, None)
    eng.replace_kv_cache(eng.layer_specs, bases=_bases())
    based, *_ = _forward(eng, None)
    assert torch.allclose(based, plain, atol=2e-5, rtol=0) and not torch.equal(based, plain)


def _scales_file(path, bases: dict[str, torch.Tensor]) -> str:
    tensors = {f"model.layers.{i}.self_attn.{s}_clip": torch.tensor([1.0]) for i in range(LAYERS) for s in "kv"}
    tensors.update(bases)
    save_file(
        tensors, str(path), metadata={"type": "int", "kv_cache_dtype": "int4_per_token_head", "int4_grid": "signed"}
    )
    return str(path)


def test_checkpoint_bases_load_and_bad_ones_name_the_file_and_field(tiny_dir, tmp_path):
    model = str(tiny_dir("llama"))
    good = {
        f"model.layers.{i}.self_attn.{n}": torch.full((HKV, D), 0.5 + i)
        for i in range(LAYERS)
        for n in ("k_mean", "k_smooth")
    }
    f = _scales_file(tmp_path / "good.safetensors", good)
    eng = LLM(model, kv_cache_dtype="int4_per_token_head", kv_scales=f, num_blocks=16).llm_engine
    assert [float(layer.key_basis.mean[0, 0]) for layer in eng.cache.layers] == [0.5, 1.5, 2.5]
    wrong = dict(good, **{"model.layers.1.self_attn.k_smooth": torch.ones(HKV, D // 2)})
    f = _scales_file(tmp_path / "wrong.safetensors", wrong)
    with pytest.raises(
        ValueError, match=r"wrong.safetensors: layer 1's k_smooth is \(2, 8\), the model's K is \(2, 16\)"
    ):
        LLM(model, kv_cache_dtype="int4_per_token_head", kv_scales=f, num_blocks=16)
    short = {k: v for k, v in good.items() if ".2." not in k}
    f = _scales_file(tmp_path / "short.safetensors", short)
    with pytest.raises(ValueError, match="key bases in .*short.safetensors cover 2 / 2 layers .* the model has 3"):
        LLM(model, kv_cache_dtype="int4_per_token_head", kv_scales=f, num_blocks=16)
    zero = dict(good, **{"model.layers.0.self_attn.k_smooth": torch.zeros(HKV, D)})
    f = _scales_file(tmp_path / "zero.safetensors", zero)
    with pytest.raises(ValueError, match="zero.safetensors: layer 0: k_mean must be finite and k_smooth finite"):
        LLM(model, kv_cache_dtype="int4_per_token_head", kv_scales=f, num_blocks=16)
