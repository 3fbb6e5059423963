"""Log-probabilities of sampled and prompt tokens, and the text of each token they name.

**Mode: raw logprobs** (vLLM's default ``logprobs_mode="raw_logprobs"``): the
``log_softmax`` of the model's logits in fp32, before temperature, top-k and
top-p. These are the very logits the sampler is handed (it applies
temperature and the filters itself), so a sampled token's logprob and its
alternatives describe the model, not the sampling settings, and a greedy
request (temperature 0, where "after temperature" has no meaning) gets the
same numbers as a sampled one. lm-eval's ``local-completions`` scores
loglikelihoods with them, which is why they must be the model's own.

A position's logprobs are a dict ``token id -> Logprob``: the chosen token (the
one sampled, or the prompt's next token) first, then the top ``k`` by rank, the
chosen one not repeated. ``rank`` is 1 + the number of tokens with a strictly
higher logprob, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Logprob", "PositionLogprobs", "TokenTexts", "position_logprobs"]


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


PositionLogprobs = dict[int, Logprob]


class TokenTexts:
    """The text of single token ids, decoded once each (special tokens kept, as vLLM shows them).

    Logprob alternatives name up to 21 tokens per position; most repeat, so a
    dict saves a tokenizer call per name. Bounded by the vocabulary.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text


def position_logprobs(
    logits: torch.Tensor, chosen: list[int], num_top: list[int], text: Callable[[int], str]
) -> list[PositionLogprobs]:
    """One dict per row of ``logits`` ([N, vocab]): ``chosen[i]`` first, then the top ``num_top[i]``."""
    logp = logits.float().log_softmax(-1)
    ids = torch.tensor(chosen, dtype=torch.long, device=logp.device)
    chosen_lp = logp.gather(1, ids[:, None])[:, 0]
    ranks = ((logp > chosen_lp[:, None]).sum(-1) + 1).tolist()
    k = max(num_top, default=0)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids, chosen_values = top_lp.tolist(), top_ids.tolist(), chosen_lp.tolist()
    out = []
    for r, token in enumerate(chosen):
        entry = {token: Logprob(chosen_values[r], ranks[r], text(token))}
        for j in range(num_top[r]):
            t = top_ids[r][j]
            if t not in entry:
                entry[t] = Logprob(top_lp[r][j], j + 1, text(t))
        out.append(entry)
    return out
