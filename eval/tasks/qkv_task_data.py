"""Data loaders for qkv's local lm-eval tasks (``custom_dataset`` in the YAML files here).

``qkv_wikitext`` reuses lm-eval's own WikiText metric functions; its documents
are the articles of the WikiText-2 raw test split, read from ``$QKV_WIKITEXT_JSONL``
when set, else split out of the local ``wiki.test.raw`` (found by
:mod:`qkv.data_files`) into a cache file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import datasets
from lm_eval.tasks.wikitext import preprocess_wikitext as _builtin

from qkv.data_files import WIKITEXT_TEST, not_found
from qkv.eval.data import wikitext_test_file
from qkv.registry import default_cache_dir

wikitext_detokenizer = _builtin.wikitext_detokenizer
wikitext_process_results = _builtin.process_results

HERE = Path(__file__).resolve().parent
CACHE = default_cache_dir() / "lm_eval"
_ARTICLE = re.compile(r"^ = [^=].* = $")


def split_articles(text: str) -> list[str]:
    """WikiText raw text -> one string per article (a `` = Title = `` line starts one)."""
    pages: list[list[str]] = []
    for line in text.replace("\r\n", "\n").splitlines(keepends=True):
        if _ARTICLE.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    return ["".join(p) for p in pages if "".join(p).strip()]


def wikitext_jsonl() -> Path:
    env = os.environ.get("QKV_WIKITEXT_JSONL")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"QKV_WIKITEXT_JSONL={env}: no such file")
        return Path(env)
    src = wikitext_test_file()
    if src is None:
        raise FileNotFoundError(
            f"qkv_wikitext: {not_found(WIKITEXT_TEST)}, or put a JSON-lines file of "
            f'{{"page": ...}} in $QKV_WIKITEXT_JSONL'
        )
    out = CACHE / "wikitext-2-raw-v1-test-articles.jsonl"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for page in split_articles(src.read_text(encoding="utf-8")):
                f.write(json.dumps({"page": page}) + "\n")
        tmp.replace(out)
    return out


def load_wikitext(**kwargs) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(wikitext_jsonl())})


def load_mc(**kwargs) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / "qkv_mc.jsonl")})
