"""Incremental detokenization equals a full decode; per-token work does not grow with the output.

The real tokenizers (SmolLM2's byte-level BPE, Gemma 3's SentencePiece with byte fallback) are checked
token by token on multi-byte text (accents, CJK, emoji with modifiers, flags) and on random token ids,
which include special tokens and lone byte tokens, with and without ``skip_special_tokens``.
"""

import random

import pytest

from qkv import LLM, SamplingParams
from qkv.detokenizer import IncrementalDetokenizer, make_decoder

TEXTS = [
    "Hello, world! Ça va? naïve café — 日本語のテキスト 🎉👍🏽 and 🇫🇷🇩🇪.",
    "def f(x):\n    return x ** 2  # ünïcødé ✓\n\n\tindented",
    "   leading and trailing spaces   ",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, 한국어",
]


def check_stream(tok, ids: list[int], skip: bool) -> None:
    """At every step the text is the full decode up to its trailing U+FFFD; after flush, all of it."""
    detok = IncrementalDetokenizer(*make_decoder(tok, skip))
    pieces = []
    for k in range(1, len(ids) + 1):
        pieces.append(detok.step(ids[:k]))
        assert detok.text == "".join(pieces) == tok.decode(ids[:k], skip_special_tokens=skip).rstrip("\ufffd")
    detok.flush(ids)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_tokenizers_match_full_decode(model):
    from transformers import AutoTokenizer

    from qkv.registry import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    assert make_decoder(tok, True)[1]  # the fast, incremental path
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = ids[:5] + [tok.eos_token_id] + ids[5:]  # a special token mid-stream
        for skip in (True, False):
            check_stream(tok, ids, skip)
    for _ in range(40):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            check_stream(tok, ids, skip)


def test_engine_text_is_the_full_decode_and_work_is_constant(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=64, max_model_len=512)
    engine = llm.llm_engine
    tok = engine.tokenizer
    decoded_lengths = []
    real = engine._decoders[True][0]
    engine._decoders[True] = (lambda ids: decoded_lengths.append(len(ids)) or real(ids), True)
    published = []
    real_cache = engine.pool.cache_full_block
    monkeypatch.setattr(engine.pool, "cache_full_block", lambda b, h: published.append(b.block_id) or real_cache(b, h))
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=300, ignore_eos=True)
    rid = engine.add_request("The quick brown fox", params)
    seq = engine.requests[rid].seqs[0]  # n=1: the request's one sequence
    tokens_list = seq.all_token_ids

    def full(out):
        return tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)

    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs[0].text == full(out).rstrip("\ufffd") or out.finished
    assert out.outputs[0].text == full(out) and len(out.outputs[0].token_ids) == 300
    assert seq.all_token_ids is tokens_list  # appended to, never rebuilt
    # short windows, so linear in the output: a full decode per step would add up to 300 * 301 / 2 = 45,150 ids
    assert max(decoded_lengths) <= 8 and sum(decoded_lengths) <= 6 * 300
    assert len(published) == len(set(published)) == (5 + 300) // 16  # each full block published once
    assert not [k for k, v in vars(engine.stats).items() if isinstance(v, (list, dict))]  # no per-request history
    engine.pool.check_no_leaks()


def test_stop_strings_across_token_boundaries(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=64)
    tok = llm.get_tokenizer()
    base = llm.generate(["Paged attention"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = base.outputs[0].text
    ids = base.outputs[0].token_ids
    # a two-character stop string made of the last character of one token and the first of the next
    ends = [len(tok.decode(ids[:k], skip_special_tokens=True)) for k in range(len(ids) + 1)]
    start, stop = next(
        (e - 1, text[e - 1 : e + 1])
        for e in ends[1:-1]
        if 0 < e < len(text) and "\ufffd" not in text[e - 1 : e + 1] and text.find(text[e - 1 : e + 1]) == e - 1
    )
    out = llm.generate(["Paged attention"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:start]
    assert out.token_ids == ids[: len(out.token_ids)]
