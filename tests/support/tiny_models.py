"""Tiny random-weight checkpoints of each supported architecture, built locally in seconds.

They have a real byte-level BPE tokenizer trained on a few sentences, so the
whole path (tokenize -> engine -> detokenize) runs as for a real model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 384

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed blocks of sixteen tokens.",
    "An eight bit cache holds twice the tokens in the same memory.",
    "Calibration observes the keys after rotary embedding and the values as projected.",
] * 20

_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

CONFIGS = {
    "llama": dict(model_type="llama", head_dim=16),
    "llama_hd48": dict(model_type="llama", head_dim=48, num_attention_heads=2, num_key_value_heads=1),
    "llama_30": dict(model_type="llama", head_dim=16, num_hidden_layers=30),  # SmolLM2's depth, tiny widths
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen2": dict(model_type="qwen2"),
    "mistral": dict(model_type="mistral", sliding_window=24, head_dim=16),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=32,
        hidden_size=96,
        sliding_window=24,
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        num_attention_heads=6,
        num_key_value_heads=2,
    ),
}


def make_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def make_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    """Write a random ``arch`` checkpoint (fp32 weights) with a tokenizer to ``path``."""
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    spec = dict(_BASE)
    spec.update(CONFIGS[arch])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so greedy outputs are not degenerate
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path
