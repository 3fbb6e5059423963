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


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([5] * 300, "prompt has 300 tokens, more than max_model_len=256"),
        ([5, 100000], "token id 100000 is outside the vocabulary"),
        ([5, True], "token id True is outside the vocabulary"),
        ("caf\udce9", r"prompt holds a lone surrogate \(U\+DCE9\) at index 3, which is not valid Unicode text"),
        (b"bytes", "prompt must be a string or a list of token ids, not bytes"),
    ],
)
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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1 or None, got 0"),
        (dict(max_tokens=2.5), "max_tokens must be an integer >= 1 or None, got 2.5"),
        (dict(temperature=-1), r"temperature must be a finite number >= 0 \(0 is greedy\), got -1"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0 .*, got inf"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0 .*, got nan"),
        (dict(top_p=0), r"top_p must be a number in \(0, 1\], got 0"),
        (dict(top_k=1.5), r"top_k must be an integer >= -1 \(0 or -1 disables\), got 1.5"),
        (dict(top_k=True), r"top_k must be an integer >= -1 \(0 or -1 disables\), got True"),
        (dict(top_k=-2), r"top_k must be an integer >= -1 \(0 or -1 disables\), got -2"),
        (dict(stop=[1]), "stop must be a non-empty string or a list of non-empty strings, got \\[1\\]"),
        (dict(stop=[""]), "stop must be a non-empty string or a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of integers >= 0, got \\[-1\\]"),
        (
            dict(seed="x"),
            "seed must be an integer in \\[-9223372036854775808, 18446744073709551615\\] or None, got 'x'",
        ),
        (dict(seed=2**70), "seed must be an integer in .* or None, got 1180591620717411303424"),
        (dict(min_tokens=5, max_tokens=2), r"min_tokens must be <= max_tokens \(2\), got 5"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
        (dict(ignore_eos="yes"), "ignore_eos must be true or false, got 'yes'"),
        (dict(n=0), r"n must be an integer in \[1, 128\], got 0"),
        (dict(n=2, best_of=1), r"best_of must be None or an integer in \[n, 128\] \(n is 2\), got 1"),
        (dict(logprobs=-1), r"logprobs must be None or an integer in \[0, 20\], got -1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_changed_after_construction_are_refused_at_add(llm):
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.stop = [1]
    with pytest.raises(ValueError, match="stop must be"):
        llm.generate(["fine prompt", "another"], sp)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.pool.check_no_leaks()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
        (dict(dtype="int4"), "dtype must be one of auto, bfloat16, .*; got 'int4'"),
        (dict(attention_backend="cuda"), "attention_backend must be one of cpu, torch, triton; got 'cuda'"),
        (dict(kv_cache_memory="-1GiB"), "kv_cache_memory must be a size > 0 .*, got '-1GiB'"),
        (dict(kv_cache_memory=0), "kv_cache_memory must be a size > 0 .*, got 0"),
        (dict(device="tpu"), "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (
            dict(kv_cache_dtype="fp4"),
            "kv_cache_dtype: unknown kv-cache dtype 'fp4'; choose one of: auto, bfloat16, fp8,",
        ),
        (dict(block_size=12), "block_size must be a power of two, got 12"),
        (dict(block_size="16"), "block_size must be an integer, got '16'"),
        (dict(max_num_seqs=True), "max_num_seqs must be an integer, got True"),
        (dict(num_blocks=1), "num_blocks must be >= 2, got 1"),
        (dict(kv_scales="/no/such/scales"), "kv_scales must name an existing file or directory, got '/no/such/scales'"),
        (
            dict(kv_cache_dtype_skip_layers=["first"]),
            "kv_cache_dtype_skip_layers: --kv-cache-dtype-skip-layers takes "
            "'sliding_window' or layer indices, got 'first'",
        ),
        (dict(kv_cache_dtype_skip_layers=[-1]), "kv_cache_dtype_skip_layers must hold layer indices >= 0, got -1"),
        (
            dict(kv_cache_dtype_skip_dtype="int8"),
            "kv_cache_dtype_skip_dtype: --kv-cache-dtype-skip-dtype must be one of auto, int8_per_token_head, "
            "fp8_per_token_head",
        ),
        (dict(prefix_caching_hash_algo="builtin"), "prefix_caching_hash_algo must be one of sha256; got 'builtin'"),
    ],
)
def test_bad_engine_config_fails_before_loading(kwargs, message):
    # "no-such-model" would raise UnknownModelError if anything were loaded first
    with pytest.raises(ValueError, match=message):
        LLM("no-such-model", **kwargs)


def test_cli_prints_one_line_for_config_errors(capsys):
    from qkv.cli import main

    assert main(["generate", "no-such-model", "--device", "tpu", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "qkv: error: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'\n"


def _random_bytes_file(path):
    import random

    path.write_bytes(random.Random(0).randbytes(2048))
    return path


def test_corrupt_scales_file_names_the_flag_and_the_file(tiny_dir, tmp_path):
    bad = _random_bytes_file(tmp_path / "scales.safetensors")
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_dir("llama")), kv_cache_dtype="fp8", kv_scales=str(bad), num_blocks=8)
    assert str(e.value).startswith(f"--kv-scales {bad}: not a readable safetensors file (SafetensorError: ")


def test_bad_config_json_in_scales_dir_names_the_file(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text("{bad json")
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_dir("llama")), kv_cache_dtype="fp8", kv_scales=str(tmp_path), num_blocks=8)
    assert str(e.value) == (
        f"--kv-scales {tmp_path}: cannot read {tmp_path / 'config.json'}: Expecting property "
        f"name enclosed in double quotes: line 1 column 2 (char 1)"
    )
    (tmp_path / "config.json").write_text('{"quantization_config": {"kv_cache_scheme": 8}}')
    with pytest.raises(ValueError, match="'kv_cache_scheme' in .*config.json must be a JSON object, not int"):
        LLM(str(tiny_dir("llama")), kv_cache_dtype="fp8", kv_scales=str(tmp_path), num_blocks=8)


def test_cli_corrupt_scales_is_one_line(tiny_dir, tmp_path, capsys):
    from qkv.cli import main

    bad = _random_bytes_file(tmp_path / "s.safetensors")
    rc = main(
        [
            "generate",
            str(tiny_dir("llama")),
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "fp8",
            "--kv-scales",
            str(bad),
            "--num-blocks",
            "8",
            "--prompt",
            "x",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"qkv: error: --kv-scales {bad}: not a readable safetensors file")
    assert not any("Traceback" in line for line in err)


def test_generate_validates_all_prompts_before_running(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", ""], GREEDY)
    assert not engine.has_unfinished_requests()
    engine.pool.check_no_leaks()
    assert json.dumps(engine.stats.snapshot())
