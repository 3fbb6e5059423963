"""Evaluation text and the token windows cut from it.

``--dataset wikitext`` (the default) is WikiText-2 raw, test split. A local copy
(``wikitext-2/wiki.test.raw``, found by :func:`qkv.data_files.find_data_file`:
``$QKV_DATA_DIR``, else the shared copy beside the checkout) is byte-for-byte the
hub's split, so it is used when present; otherwise the hub dataset
``wikitext``/``wikitext-2-raw-v1`` is loaded. Either way the text goes through
``datasets`` and CRLF is normalised to LF.
Any other ``--dataset`` is a local ``.txt``/``.raw`` file or a ``.jsonl`` file
with a ``text`` (or ``page``) field.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import datasets

from qkv.data_files import WIKITEXT_TEST, WIKITEXT_VALID, find_data_file, not_found

__all__ = ["EvalText", "load_text", "make_windows", "wikitext_test_file", "wikitext_valid_file", "DataError"]

WIKITEXT_NAMES = ("wikitext", "wikitext2", "wikitext-2", "wikitext-2-raw-v1")


class DataError(ValueError):
    """The dataset is missing or too small for the requested windows."""


@dataclass
class EvalText:
    name: str
    source: str  # file path or hub id
    text: str
    sha256: str  # of the normalised text (what is tokenized)
    file_sha256: str | None = None


def wikitext_test_file() -> Path | None:
    """The local WikiText-2 raw test file, or ``None`` when there is none (see :mod:`qkv.data_files`)."""
    return find_data_file(WIKITEXT_TEST)


def wikitext_valid_file() -> Path | None:
    """The local WikiText-2 validation file (calibration text for ``--search``), or ``None``."""
    return find_data_file(WIKITEXT_VALID)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _load_file(path: Path) -> str:
    datasets.disable_progress_bars()
    if path.suffix in (".jsonl", ".json"):
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
        field = "text" if "text" in ds.column_names else "page" if "page" in ds.column_names else None
        if field is None:
            raise DataError(f"{path}: a JSON-lines dataset needs a 'text' or 'page' field, found {ds.column_names}")
        return "\n\n".join(ds[field])
    ds = datasets.load_dataset("text", data_files=str(path), split="train", keep_linebreaks=True)
    return "".join(ds["text"])


def load_text(dataset: str = "wikitext") -> EvalText:
    if dataset.lower() in WIKITEXT_NAMES:
        path = wikitext_test_file()
        if path is not None:
            text = _load_file(path).replace("\r\n", "\n")
            return EvalText("wikitext-2-raw-v1/test", str(path), text, _sha(text.encode()), _sha(path.read_bytes()))
        try:
            ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        except Exception as e:  # noqa: BLE001 - no hub, no local copy: say both
            raise DataError(
                f"WikiText-2 is not available: {not_found(WIKITEXT_TEST)}; and the hub failed: {e}"
            ) from None
        text = "".join(ds["text"]).replace("\r\n", "\n")
        return EvalText("wikitext-2-raw-v1/test", "hub:wikitext/wikitext-2-raw-v1", text, _sha(text.encode()))
    path = Path(dataset)
    if not path.is_file():
        raise DataError(f"--dataset {dataset}: not a known dataset name ({', '.join(WIKITEXT_NAMES)}) and no such file")
    text = _load_file(path).replace("\r\n", "\n")
    return EvalText(path.name, str(path), text, _sha(text.encode()), _sha(path.read_bytes()))


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos is not None and bool(ids) and ids[0] == bos


def make_windows(tokenizer, text: str, num_windows: int, window: int) -> list[list[int]]:
    """``num_windows`` windows of ``window`` tokens, evenly spread over the text.

    A window is the tokenizer's BOS (when it adds one, as Gemma's does) followed
    by ``window - 1`` text tokens, or ``window`` text tokens otherwise; every
    next-token prediction inside the window is scored. Windows never overlap.
    """
    if num_windows < 1 or window < 2:
        raise DataError(f"need at least 1 window of at least 2 tokens, got {num_windows} x {window}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    span = window - len(bos)
    if len(ids) < num_windows * span:
        raise DataError(
            f"the dataset has {len(ids):,} tokens, fewer than the {num_windows} x {span:,} = "
            f"{num_windows * span:,} that {num_windows} windows of {window} tokens need; "
            f"lower --num-windows or --window"
        )
    stride = len(ids) // num_windows
    return [bos + ids[i * stride : i * stride + span] for i in range(num_windows)]
