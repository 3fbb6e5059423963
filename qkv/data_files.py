"""Where qkv looks for data files it does not ship (WikiText-2 for ``qkv eval``, ``--search`` and the tests).

The one rule, in order:

1. a path given explicitly (``--dataset FILE``, ``--calib-dataset FILE``) is used as it is;
   callers never get here for it;
2. ``$QKV_DATA_DIR/<name>``, e.g. ``$QKV_DATA_DIR/wikitext-2/wiki.test.raw``;
3. the shared copy beside a source checkout: ``<checkout>/../shared/data/<name>``
   (``<checkout>`` is the directory that holds ``qkv/``; an installed wheel has none);
4. nothing: :func:`find_data_file` returns ``None`` and the caller falls back to the
   Hugging Face hub through ``datasets`` (WikiText-2) or says what it looked for.

No other module of qkv names a data directory.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "WIKITEXT_TEST", "WIKITEXT_VALID", "data_dirs", "find_data_file", "not_found"]

DATA_DIR_ENV = "QKV_DATA_DIR"
WIKITEXT_TEST = "wikitext-2/wiki.test.raw"  # WikiText-2 raw, test split (byte-for-byte the hub's)
WIKITEXT_VALID = "wikitext-2/wiki.valid.tokens"  # validation split: calibration text, never evaluated on
_CHECKOUT = Path(__file__).resolve().parent.parent


def data_dirs() -> list[Path]:
    """The directories searched, in order: ``$QKV_DATA_DIR`` (when set), then the checkout's shared copy."""
    dirs = [Path(os.environ[DATA_DIR_ENV]).expanduser()] if os.environ.get(DATA_DIR_ENV) else []
    return dirs + [_CHECKOUT.parent / "shared" / "data"]


def find_data_file(name: str) -> Path | None:
    """``name`` (e.g. :data:`WIKITEXT_TEST`) in the first of :func:`data_dirs` that has it, else ``None``."""
    return next((d / name for d in data_dirs() if (d / name).is_file()), None)


def not_found(name: str) -> str:
    """What to say when :func:`find_data_file` found nothing: every path it tried, and the fix."""
    looked = ", ".join(str(d / name) for d in data_dirs())
    return f"{name} not found (looked for {looked}); set ${DATA_DIR_ENV} to a directory that holds it"
