"""Data-free calibration: samples the model writes itself, from a few neutral seed prompts.

Used when ``qkv calibrate`` gets no ``--dataset``. Each sample is a seed prompt
(cycled) continued by sampling (temperature 1.0, top-p 0.95, per-sample seed
derived from ``--seed``) until it is ``seq_len`` tokens long, ignoring EOS.
calibration.json records ``"source": "self-generated"`` and the prompts.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from qkv.sampling import SamplingParams

from .data import Samples, prompt_prefix

__all__ = ["SEED_PROMPTS", "GEN_BATCH", "generate_samples"]

SEED_PROMPTS = (
    "The",
    "In the beginning,",
    "Here is a short explanation of how",
    "Once upon a time",
    "The following article describes",
    "Question: What is the best way to",
    "def main():",
    "It was a quiet morning when",
)
GEN_BATCH = 16  # sequences generated at once (bounds the cache the engine needs)


def generate_samples(llm, num_samples: int, seq_len: int, seed: int = 0, progress: bool = True) -> Samples:
    tok = llm.get_tokenizer()
    prefix = prompt_prefix(tok)
    prompts = []
    for i in range(num_samples):
        ids = prefix + tok(SEED_PROMPTS[i % len(SEED_PROMPTS)], add_special_tokens=False)["input_ids"]
        prompts.append(ids[: max(1, seq_len - 1)])
    chunks: list[list[int]] = []
    bar = tqdm(total=num_samples, desc="generating", unit="sample", disable=not progress)
    for start in range(0, num_samples, GEN_BATCH):
        batch = prompts[start : start + GEN_BATCH]
        params = [
            SamplingParams(
                temperature=1.0,
                top_p=0.95,
                seed=seed * 1_000_003 + start + j,
                max_tokens=seq_len - len(p),
                ignore_eos=True,
            )
            for j, p in enumerate(batch)
        ]
        for p, out in zip(batch, llm.generate(batch, params)):
            chunks.append((p + list(out.outputs[0].token_ids))[:seq_len])
        bar.update(len(batch))
    bar.close()
    info = {
        "source": "self-generated",
        "prompts": list(SEED_PROMPTS),
        "sampling": {"temperature": 1.0, "top_p": 0.95, "ignore_eos": True},
        "seed": seed,
        "num_samples": num_samples,
        "seq_len": seq_len,
        "tokens": sum(len(c) for c in chunks),
    }
    return Samples(chunks, info)
