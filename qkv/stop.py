"""When a sequence is done: EOS, stop token ids, stop strings, ``max_tokens``, ``max_model_len``."""

from __future__ import annotations

from .sequence import Sequence, SequenceStatus

__all__ = ["check_stop"]


def check_stop(seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> None:
    """Detokenize the new token and decide whether the sequence is done; O(1) in the output length.

    Stop strings are searched only where they can newly occur: in the text
    added since the last search, plus the ``len(stop) - 1`` characters
    before it.
    """
    p = seq.params
    last = seq.output_token_ids[-1]
    n_out = len(seq.output_token_ids)
    detok = seq.detokenizer
    detok.step(seq.output_token_ids)
    seq.output_text = detok.text
    if n_out >= p.min_tokens:
        if not p.ignore_eos and last in eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif last in p.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, last
        else:
            checked = seq.stop_checked if detok.append_only else 0
            for s in p.stop:
                at = seq.output_text.find(s, max(0, checked - len(s) + 1))
                if at != -1:
                    seq.output_text = seq.output_text[:at]
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, s
                    return
            seq.stop_checked = len(seq.output_text)
    if not seq.finished and ((p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len):
        seq.status = SequenceStatus.FINISHED_LENGTH
    if seq.finished:  # the text of an unfinished last character too, as a full decode gives it
        detok.flush(seq.output_token_ids)
        seq.output_text = detok.text
