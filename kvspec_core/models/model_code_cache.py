"""Readings of transformers' model code kept on disk between runs.

Importing transformers' modeling code is most of what the model-code check costs (about a
second; building the model on the meta device takes a tenth of that), so ``kvspec plan`` of a
config it has checked before reads the reading back instead. An entry is keyed by the config
text, the layer count, the installed transformers version and the text of the check's own
rules (:mod:`kvspec_core.models.model_code_reader`), so a new transformers or changed rules
read the model code again. An entry that cannot be read or does not have the expected shape
is ignored and rebuilt; a cache that cannot be written is skipped (it only saves time).

Where: ``$KVSPEC_CACHE_DIR`` (empty: no disk cache), else ``$XDG_CACHE_HOME/kvspec``, else
``~/.cache/kvspec``; entries live in its ``model-code`` folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

#: Environment variable naming the cache folder (empty: no disk cache).
CACHE_DIR_VARIABLE = "KVSPEC_CACHE_DIR"
#: Sub-folder of the cache folder holding model-code readings.
READINGS_FOLDER = "model-code"


def cache_folder() -> Path | None:
    """Where readings are kept, or ``None`` when the disk cache is off."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    if chosen is not None:
        return Path(chosen) / READINGS_FOLDER if chosen else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvspec" / READINGS_FOLDER


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"


def entry_key(config_json: str, count: int, rules_digest: str) -> str:
    """The key of the reading of ``config_json`` with ``count`` decoder layers, made by the
    rules whose source text has the digest ``rules_digest`` (the check passes its own, so this
    module does not import it back)."""
    text = "\0".join((rules_digest, _transformers_version(), str(count), config_json))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_entry(key: str) -> dict[str, Any] | None:
    """The stored entry ``key``, or ``None`` (no disk cache, no entry, unreadable)."""
    folder = cache_folder()
    if folder is None:
        return None
    try:
        data = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def store_entry(key: str, data: dict[str, Any]) -> None:
    """Keep ``data`` as entry ``key``, written whole or not at all."""
    folder = cache_folder()
    if folder is None:
        return
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                json.dump(data, stream)
            os.replace(temporary, folder / f"{key}.json")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
