"""Logprobs (raw mode) equal log_softmax of a transformers fp32 forward, prompt and sampled tokens alike."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [(5 * i) % 380 + 3 for i in range(21)]


def test_logprobs_match_transformers_fp32(tiny_dir):
    path = str(tiny_dir("llama"))
    llm = LLM(path, dtype="float32", num_blocks=32, kv_cache_dtype="auto", attention_backend="torch")
    assert "float32" in llm.llm_engine.cache.dtype_summary()
    # temperature 2: raw logprobs are the model's, not the sampler's tempered distribution
    params = SamplingParams(temperature=2.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    comp = out.outputs[0]
    tokens = PROMPT + comp.token_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)

    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        pos = out.prompt_logprobs[p]
        assert list(pos)[0] == PROMPT[p]  # the prompt's own token first
        assert abs(pos[PROMPT[p]].logprob - ref[p - 1, PROMPT[p]].item()) < 1e-4
        top2 = ref[p - 1].topk(2).indices.tolist()
        assert all(t in pos for t in top2) and len(pos) <= 3
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    total = 0.0
    for j, (token, pos) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(PROMPT) - 1 + j]
        assert abs(pos[token].logprob - row[token].item()) < 1e-4
        assert pos[token].rank == int((row > row[token]).sum()) + 1
        for t in row.topk(3).indices.tolist():
            assert abs(pos[t].logprob - row[t].item()) < 1e-4
        total += pos[token].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-6
