"""Calibration data: load rows with the ``datasets`` library, turn them into token chunks.

``--dataset`` is a local ``.txt``/``.jsonl``/``.json``/``.parquet``/``.csv`` file or a
folder of them (any other extension is read as plain text, e.g. WikiText's
``wiki.valid.tokens``; text files are UTF-8 with or without BOM, one document
per file), or a Hugging Face hub dataset name when the hub is reachable (hub
datasets already in the local ``datasets`` cache also load offline).

Rows with a ``messages`` column (chat style) go through the model's chat
template. Samples are then built in one of two ways:

* ``pack`` (default for text): documents in order, tokenized and concatenated
  (separated by a blank line) into one stream of up to ``8 * N * L`` tokens,
  cut into ``L``-token chunks; ``N`` of them are drawn with ``random.Random(seed)``;
* ``truncate`` (default for chat rows): rows shuffled with ``seed``, each
  tokenized and cut to ``L`` tokens; the first ``N`` non-empty ones are kept.

Every chunk starts with whatever special tokens the tokenizer puts in front of
a prompt (e.g. Gemma's ``<bos>``), exactly as a served prompt would.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import huggingface_hub.constants as hub_constants

__all__ = ["PACKINGS", "Samples", "RawData", "load_rows", "build_samples", "hub_offline_reason", "prompt_prefix"]

PACKINGS = ("auto", "pack", "truncate")  # auto: truncate chat rows, pack plain text

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_TEXT_COLUMNS = ("text", "content", "document", "sentence")
POOL_FACTOR = 8


@dataclass
class RawData:
    """Rows as loaded, before tokenization."""

    texts: list  # strings, or lists of chat messages when ``chat``
    chat: bool
    info: dict = field(default_factory=dict)


@dataclass
class Samples:
    """Token chunks to observe, plus where they came from (written to calibration.json)."""

    chunks: list[list[int]]
    info: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.chunks)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline_reason() -> str | None:
    """Why the hub cannot be used (offline mode or unreachable), or ``None`` if it can."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if _env_true(var):
            return f"{var}=1 is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
        return f"{host} is unreachable ({e.__class__.__name__})"
    return None


def _looks_like_path(name: str) -> bool:
    """Hub names are ``name`` or ``org/name``; anything else that does not exist is a missing path."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or Path(name).suffix.lower() in (*_BUILDERS, ".txt", ".text", ".tokens", ".raw", ".md")
    )


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts))
    )
    if not files:
        raise ValueError(f"--dataset {path}: the folder holds no data files (empty dataset)")
    kinds = {_BUILDERS.get(p.suffix.lower(), "text") for p in files}
    if len(kinds) > 1:
        raise ValueError(
            f"--dataset {path}: mixes file types ({', '.join(sorted(kinds))}); put one kind of file in the folder"
        )
    return kinds.pop(), [str(p) for p in files]


def _load_local(path: Path, split: str | None):
    builder, files = _local_files(path)
    kwargs = {"sample_by": "document", "encoding": "utf-8-sig"} if builder == "text" else {}
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"--dataset {path}: empty dataset (no rows)")
    try:
        ds = datasets.load_dataset(builder, data_files={"train": files}, split=split or "train", **kwargs)
    except ValueError as e:
        if "corresponds to no data" in str(e):  # datasets' words for a file without rows
            raise ValueError(f"--dataset {path}: empty dataset (no rows)") from None
        raise ValueError(f"--dataset {path}: {e}") from None
    except Exception as e:  # malformed JSON, unreadable parquet, ...
        raise ValueError(f"--dataset {path}: cannot read it as {builder}: {e.__class__.__name__}: {e}") from None
    return ds, {
        "source": "local",
        "path": str(path.resolve()),
        "format": builder,
        "files": len(files),
        "split": split or "train",
    }


def _load_hub(name: str, config: str | None, split: str | None):
    offline = hub_offline_reason()
    try:
        if offline:  # the local datasets cache may still have it: try it without touching the network
            saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
            datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
            try:
                ds = datasets.load_dataset(name, config, split=split or "train")
            finally:
                datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        else:
            ds = datasets.load_dataset(name, config, split=split or "train")
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError, FileNotFoundError) as e:
        if offline:
            raise ValueError(
                f"--dataset {name!r} is not a local file or folder, and the Hugging Face hub is offline "
                f"({offline}) with no cached copy; pass a local .txt, .jsonl, .json or .parquet file "
                f"or folder"
            ) from None
        raise ValueError(
            f"unknown dataset {name!r}: not a local file or folder and not found on the "
            f"Hugging Face hub ({e.__class__.__name__}: {e})"
        ) from None
    except ValueError as e:  # missing config name, unknown split, ...
        raise ValueError(f"--dataset {name}: {e}") from None
    return ds, {"source": "hub", "name": name, "config": config, "split": split or "train"}


def load_rows(
    dataset: str, config: str | None = None, split: str | None = None, text_column: str | None = None
) -> RawData:
    """Load ``dataset`` and pick its text (or ``messages``) column; no tokenizer needed yet."""
    path = Path(dataset).expanduser()
    if path.exists():
        ds, info = _load_local(path, split)
    elif _looks_like_path(dataset):
        raise ValueError(f"unknown dataset {dataset!r}: no such file or folder")
    else:
        ds, info = _load_hub(dataset, config, split)
    columns = list(ds.column_names)
    if text_column is not None:
        if text_column not in columns:
            raise ValueError(
                f"--text-column {text_column!r} is not in the dataset; available columns: {', '.join(columns)}"
            )
        column = text_column
    elif "messages" in columns:
        column = "messages"
    else:
        column = next((c for c in _TEXT_COLUMNS if c in columns), None)
        if column is None:
            raise ValueError(
                f"cannot tell which column holds the text; pass --text-column (available columns: {', '.join(columns)})"
            )
    if len(ds) == 0:
        raise ValueError(f"--dataset {dataset}: empty dataset (no rows)")
    rows = ds[column]
    chat = bool(rows) and isinstance(rows[0], list) and (not rows[0] or isinstance(rows[0][0], dict))
    if not chat:
        bad = next((r for r in rows if r is not None and not isinstance(r, str)), None)
        if bad is not None:
            raise ValueError(
                f"column {column!r} holds {type(bad).__name__} values, not text or chat "
                f"messages; pass --text-column (available columns: {', '.join(columns)})"
            )
        rows = [r for r in rows if r and r.strip()]
    else:
        rows = [r for r in rows if r]
    if not rows:
        raise ValueError(f"--dataset {dataset}: empty dataset (column {column!r} has no non-empty rows)")
    info.update(column=column, chat=chat, rows=len(rows))
    return RawData(rows, chat, info)


def prompt_prefix(tokenizer) -> list[int]:
    """Special tokens the tokenizer puts in front of any prompt (BOS for Gemma/Llama 2, none for SmolLM2)."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return list(ids)


def _render(tokenizer, row, chat: bool) -> tuple[str, bool]:
    """Row -> (text, already has its special tokens)."""
    if not chat:
        return row, False
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the dataset has chat-style 'messages' rows but the model's tokenizer has no chat "
            "template; pass --text-column with a plain-text column"
        )
    return tokenizer.apply_chat_template(row, tokenize=False), True


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def build_samples(
    raw: RawData, tokenizer, num_samples: int, seq_len: int, seed: int = 0, packing: str = "auto"
) -> Samples:
    """``num_samples`` chunks of (at most, for ``truncate``) ``seq_len`` tokens, reproducible for ``seed``."""
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need --num-samples >= 1 and --seq-len >= 2, got {num_samples} and {seq_len}")
    if packing == "auto":
        packing = "truncate" if raw.chat else "pack"
    if packing not in PACKINGS[1:]:
        raise ValueError(f"--packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
    prefix = prompt_prefix(tokenizer)
    body = seq_len - len(prefix)
    rng = random.Random(seed)
    info = dict(raw.info, packing=packing, seed=seed, num_samples=num_samples, seq_len=seq_len)
    if packing == "truncate":
        order = list(range(len(raw.texts)))
        rng.shuffle(order)
        chunks = []
        for i in order:
            text, templated = _render(tokenizer, raw.texts[i], raw.chat)
            ids = _encode(tokenizer, text) if templated else prefix + _encode(tokenizer, text)
            if ids:
                chunks.append(ids[:seq_len])
            if len(chunks) == num_samples:
                break
        if len(chunks) < num_samples:
            raise ValueError(
                f"the dataset has only {len(chunks)} non-empty rows, fewer than "
                f"--num-samples {num_samples} (--packing truncate takes one sample per row)"
            )
        return Samples(chunks, dict(info, tokens=sum(len(c) for c in chunks)))
    budget = POOL_FACTOR * num_samples * body
    stream: list[int] = []
    for row in raw.texts:
        text, _ = _render(tokenizer, row, raw.chat)
        if not raw.chat and not text.endswith("\n"):
            text += "\n\n"
        stream.extend(_encode(tokenizer, text[: 16 * budget]))
        if len(stream) >= budget:
            break
    available = len(stream) // body
    if available < num_samples:
        raise ValueError(
            f"too few tokens: the dataset has {len(stream):,} tokens, which make {available} samples of "
            f"{seq_len} tokens; --num-samples {num_samples} x --seq-len {seq_len} needs "
            f"{num_samples * seq_len:,}. Lower --num-samples or --seq-len, or use more data"
        )
    picks = sorted(rng.sample(range(available), num_samples))
    chunks = [prefix + stream[i * body : (i + 1) * body] for i in picks]
    info.update(pool_tokens=len(stream), pool_chunks=available, tokens=num_samples * seq_len)
    return Samples(chunks, info)
