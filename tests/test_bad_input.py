"""Bad input gets a clear error naming the problem; the engine keeps serving and leaks no blocks."""

import json

import pytest

from qkv import LLM, SamplingParams
from qkv.registry import CheckpointError, UnknownModelError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=20, max_model_len=256)


def test_unknown_model_name():
    with pytest.raises(UnknownModelError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        LLM("no-such-model")


def test_missing_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_corrupt_checkpoint(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    bad = tmp_path / "corrupt"
    bad.mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) // 3] if f.suffix == ".safetensors" else data)
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(bad))


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([5] * 300, "prompt has 300 tokens, more than max_model_len=256"),
    ([5, 100000], "token id 100000 is outside the vocabulary"),
])
def test_bad_request_rejected_while_others_run(llm, prompt, message):
    engine = llm.llm_engine
    good = engine.add_request("The quick brown fox", GREEDY)
    engine.step()
    free_before = engine.pool.num_free_blocks
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, GREEDY)
    assert engine.pool.num_free_blocks == free_before
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    assert list(done) == [good] and len(done[good].outputs[0].token_ids) == 12
    engine.pool.check_no_leaks()


def test_request_needing_more_blocks_than_exist(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=5, max_model_len=512)
    engine = llm.llm_engine
    good = engine.add_request([5] * 20, SamplingParams(temperature=0, max_tokens=10))
    engine.step()
    with pytest.raises(ValueError, match=r"request needs 7 KV blocks \(100 tokens\) but the cache has only 4"):
        engine.add_request([5] * 90, SamplingParams(max_tokens=10))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    assert list(done) == [good] and len(done[good].outputs[0].token_ids) == 10
    engine.pool.check_no_leaks()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(n=2), "n must be 1"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_validates_all_prompts_before_running(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", ""], GREEDY)
    assert not engine.has_unfinished_requests()
    engine.pool.check_no_leaks()
    assert json.dumps(engine.stats.snapshot())
