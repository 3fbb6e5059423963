"""The engine's logprobs in OpenAI's response shapes (chat and completions), as vLLM renders them.

The engine gives, per position, a dict ``token id -> Logprob`` whose first
entry is the chosen token, then the top ``k`` (``qkv/logprobs.py``). JSON has no
``-inf`` (or NaN), so a logprob below -9999 is sent as -9999.0, vLLM's value.
"""

from __future__ import annotations

from ..logprobs import Logprob, PositionLogprobs

__all__ = ["CompletionLogprobs", "chat_logprobs", "json_logprob"]


def json_logprob(x: float) -> float:
    return x if x >= -9999.0 else -9999.0  # NaN compares false, so it becomes -9999.0 too


def _chat_entry(lp: Logprob) -> dict:
    return {
        "token": lp.decoded_token,
        "logprob": json_logprob(lp.logprob),
        "bytes": list(lp.decoded_token.encode("utf-8", "replace")),
    }


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> dict:
    """``choices[].logprobs`` of a chat completion (or chunk): ``{"content": [...], "refusal": None}``.

    Each token's ``top_logprobs`` are its position's ``k`` best tokens by rank,
    the chosen one among them if it is one of the ``k``.
    """
    content = []
    for token, pos in zip(token_ids, positions):
        best = sorted(pos.values(), key=lambda lp: lp.rank)[:k]
        content.append({**_chat_entry(pos[token]), "top_logprobs": [_chat_entry(lp) for lp in best]})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """``choices[].logprobs`` of a completion: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    ``top_logprobs`` maps token text to logprob for the chosen token and the
    top ``k`` (so up to ``k + 1`` entries; tokens with the same text collapse,
    as in vLLM and OpenAI). A prompt's first token has no logprob: ``None`` in
    both lists, with its text from ``first_token_text``. ``text_offset`` is
    each token's character offset in the choice's text; streamed chunks
    continue the count, so one object is kept per choice.
    """

    def __init__(self, token_ids: bool = False) -> None:
        self.offset = 0
        self.token_ids = token_ids  # vLLM's return_tokens_as_token_ids: "token_id:N" for the token's text

    def __call__(
        self, token_ids: list[int], positions: list[PositionLogprobs | None], first_token_text: str = ""
    ) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, pos in zip(token_ids, positions):
            if pos is None:
                text = f"token_id:{token}" if self.token_ids else first_token_text
                token_logprobs.append(None)
                top.append(None)
            elif self.token_ids:
                text = f"token_id:{token}"
                token_logprobs.append(json_logprob(pos[token].logprob))
                top.append({f"token_id:{t}": json_logprob(lp.logprob) for t, lp in pos.items()})
            else:
                text = pos[token].decoded_token
                token_logprobs.append(json_logprob(pos[token].logprob))
                top.append({lp.decoded_token: json_logprob(lp.logprob) for lp in pos.values()})
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
