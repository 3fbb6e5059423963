"""Calibration data: local files through `datasets`, chat rows through the chat template, packing, seeds."""

import json

import pytest

from qkv.calibrate.data import build_samples, load_rows
from qkv.data_files import WIKITEXT_VALID

TEXT = (
    "Calibration observes the keys after rotary embedding and the values as projected. "
    "The quick brown fox jumps over the lazy dog. "
) * 40


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir("llama")))


def test_txt_with_bom_is_one_document(tmp_path, tok):
    f = tmp_path / "corpus.txt"
    f.write_bytes("\ufeff".encode() + TEXT.encode())
    raw = load_rows(str(f))
    assert raw.texts == [TEXT] and not raw.chat and raw.info["format"] == "text"
    s = build_samples(raw, tok, num_samples=4, seq_len=32, seed=0)
    assert [len(c) for c in s.chunks] == [32] * 4 and s.num_tokens == 128
    stream = tok(TEXT, add_special_tokens=False)["input_ids"]
    joined = " ".join(map(str, stream))
    assert all(" ".join(map(str, c)) in joined for c in s.chunks)  # chunks are contiguous slices
    assert s.info["packing"] == "pack" and s.info["seed"] == 0


def test_seed_makes_the_draw_reproducible(tmp_path, tok):
    f = tmp_path / "corpus.tokens"  # any extension reads as plain text
    f.write_text(TEXT * 3)
    raw = load_rows(str(f))
    a = build_samples(raw, tok, 4, 32, seed=1).chunks
    assert a == build_samples(load_rows(str(f)), tok, 4, 32, seed=1).chunks
    assert a != build_samples(raw, tok, 4, 32, seed=2).chunks


def test_jsonl_parquet_and_folder(tmp_path, tok):
    rows = [{"text": TEXT[i * 100 : (i + 1) * 100], "id": i} for i in range(30)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    raw = load_rows(str(jl))
    assert raw.info["column"] == "text" and len(raw.texts) == 30
    import datasets

    pq = tmp_path / "pq"
    pq.mkdir()
    datasets.Dataset.from_list(rows[:15]).to_parquet(str(pq / "a.parquet"))
    datasets.Dataset.from_list(rows[15:]).to_parquet(str(pq / "b.parquet"))
    raw = load_rows(str(pq))
    assert raw.info["format"] == "parquet" and raw.info["files"] == 2 and len(raw.texts) == 30
    assert len(build_samples(raw, tok, 2, 64).chunks) == 2
    raw = load_rows(str(jl), text_column="text")
    assert raw.info["column"] == "text"


def test_chat_rows_use_the_chat_template(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir("llama")))
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i} about foxes"},
                {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."},
            ]
        }
        for i in range(6)
    ]
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(rows))
    raw = load_rows(str(f))
    assert raw.chat and raw.info["column"] == "messages"
    s = build_samples(raw, tok, num_samples=3, seq_len=24, seed=0)
    assert s.info["packing"] == "truncate" and len(s.chunks) == 3
    rendered = tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    full = tok(rendered, add_special_tokens=False)["input_ids"]
    assert any(c == full[:24] or c[:5] == full[:5] for c in s.chunks)
    assert s.chunks[0][0] == tok.convert_tokens_to_ids("<s>")  # template tokens, not plain text
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template; pass --text-column"):
        build_samples(raw, tok, 3, 24)


def test_bos_prefix_is_kept_like_a_served_prompt(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir("gemma3")))
    prefix = tok("", add_special_tokens=True)["input_ids"]
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    s = build_samples(load_rows(str(f)), tok, 3, 32)
    assert all(len(c) == 32 and c[: len(prefix)] == prefix for c in s.chunks)


def test_wikitext_valid_tokens(tok, data_file):
    raw = load_rows(str(data_file(WIKITEXT_VALID)))
    assert len(raw.texts) == 1 and raw.texts[0].startswith(" \n = Homarus gammarus")  # BOM stripped
    s = build_samples(raw, tok, 8, 128, seed=0)
    assert len(s.chunks) == 8 and s.info["pool_chunks"] >= 8
