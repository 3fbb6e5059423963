import os
import sys
from pathlib import Path

import pytest
import torch

# Triton decides at decoration time whether to interpret: set this before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
WIKITEXT = SHARED / "data" / "wikitext-2"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir("llama")`` -> path of a tiny random checkpoint, built once per session."""
    base = tmp_path_factory.mktemp("tiny")

    def make(arch: str) -> Path:
        return make_tiny_model(arch, base / arch)

    return make


def pytest_collection_modifyitems(config, items):
    # Real-model tests pull and convert checkpoints on first use; QKV_SKIP_SLOW=1 leaves them out.
    if os.environ.get("QKV_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="QKV_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
