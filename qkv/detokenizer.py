"""Incremental detokenization: each new token costs the decode of a short window, not of the whole output.

Decoding the whole output at every step makes a request's detokenization
quadratic in its length. The tokenizers library's ``DecodeStream`` solves this
with a sliding window; :class:`IncrementalDetokenizer` is the same algorithm
with two differences that keep its text equal to a full ``decode`` of the
output at every step, except for a tail that is not yet final:

* It emits everything up to trailing U+FFFD characters (bytes of a character
  still incomplete), where ``DecodeStream`` holds back the whole window. A stop
  string is therefore found at the same token as when the whole output was
  decoded at every step.
* ``flush`` emits the tail at the end, so a request that ends inside a
  character ends with U+FFFD, as a full decode does.

The window keeps the tokens of the last emission as context, because decoders
treat the first token of a string specially (SentencePiece's leading-space
rule, for one). Tokenizers whose Python-side post-processing
(``clean_up_tokenization_spaces``) rewrites text across token boundaries get
the exact, quadratic full decode instead (:func:`make_decoder`).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["IncrementalDetokenizer", "make_decoder"]

REPLACEMENT = "\ufffd"

Decode = Callable[[list[int]], str]


def make_decoder(tokenizer, skip_special_tokens: bool) -> tuple[Decode, bool]:
    """``(decode, incremental)``: the fastest decode function that agrees with ``tokenizer.decode``.

    ``incremental`` is False when a window decode may differ from a full one.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "decode")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return (lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)), True
    return (lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)), not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    )


def _stable_end(text: str) -> int:
    """Length of ``text`` without its trailing U+FFFD characters."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    return end


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text; ``text`` is everything final so far.

    ``step(ids)`` is called after each append to ``ids`` (the request's whole
    output, which only grows) and returns the new text. ``append_only`` is
    False for the full-decode fallback, whose text may change anywhere.
    """

    def __init__(self, decode: Decode, incremental: bool = True) -> None:
        self._decode = decode
        self._incremental = incremental
        self.text = ""
        self._start = 0  # first token of the window
        self._sent = 0  # characters of decode(window) already emitted
        self._window_text = ""  # decode(window)[:_sent], to check that the window decodes consistently

    @property
    def append_only(self) -> bool:
        return self._incremental

    def step(self, ids: list[int]) -> str:
        return self._advance(ids, final=False)

    def flush(self, ids: list[int]) -> str:
        """The rest of the text, trailing U+FFFD included (call once, when the request ends)."""
        return self._advance(ids, final=True)

    def _advance(self, ids: list[int], final: bool) -> str:
        if not self._incremental:  # exact fallback: decode everything
            full = self._decode(ids)
            self.text = full if final else full[: _stable_end(full)]
            return ""
        window = self._decode(ids[self._start :])
        if not window.startswith(self._window_text):
            # The window decoded differently from before: widen it to the whole output, which is
            # always consistent with what was emitted from it.
            self._start, self._sent, self._window_text = 0, len(self.text), self.text
            window = self._decode(ids)
        end = len(window) if final else _stable_end(window)
        delta = window[self._sent : end] if end > self._sent else ""
        self.text += delta
        if end == len(window) and len(ids) - self._start > 1:
            # Everything is final: the newest token becomes the window's context (as in DecodeStream).
            self._start = len(ids) - 1
            self._window_text = self._decode(ids[self._start :])
            self._sent = len(self._window_text)
        else:
            self._sent, self._window_text = max(end, self._sent), window[: max(end, self._sent)]
        return delta
