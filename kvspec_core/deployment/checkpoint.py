"""A checkpoint's stored size from its safetensors metadata, read locally (a model folder,
or the Hugging Face hub cache for a hub id): never downloaded, never the weights themselves.

``model.safetensors.index.json`` (a sharded checkpoint) states ``metadata.total_size``, the
bytes of every tensor as stored, so quantised checkpoints (fp8, mxfp4 blocks and scales,
AWQ/GPTQ packed integers) count as stored. A single ``model.safetensors`` has no index; its
header (an 8-byte length, then JSON with each tensor's byte range) gives the same sum.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import attrs

from kvspec_core.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: A safetensors header larger than this is refused (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


@attrs.frozen(kw_only=True)
class CheckpointSize:
    """Bytes a checkpoint stores, and the file that says so."""

    total_bytes: int
    path: Path
    kind: str  # "safetensors index" or "safetensors header"


def _index_total(path: Path) -> int:
    try:
        document: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the safetensors index {path}: {error}") from None
    metadata = document.get("metadata") if isinstance(document, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    # Some exporters write total_size as a float (e.g. 16060522496.0); an integral one is fine.
    if isinstance(total, float) and total.is_integer():
        total = int(total)
    if type(total) is not int or total <= 0:
        raise ConfigError(
            f"the safetensors index {path} has no positive integer metadata.total_size "
            f"(found {total!r}); fix or remove the file, and the weights are counted from "
            "the model's parameters instead"
        )
    return total


def _header_total(path: Path) -> int:
    try:
        with path.open("rb") as file:
            prefix = file.read(8)
            if len(prefix) != 8:
                raise ValueError("shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} out of range")
            header: Any = json.loads(file.read(length))
        total = 0
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            begin, end = tensor["data_offsets"]
            if not 0 <= begin <= end:
                raise ValueError(f"tensor {name!r} has data_offsets {begin}, {end}")
            total += end - begin
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"cannot read the safetensors header of {path}: {error}; fix or remove the file"
        ) from None
    if total <= 0:
        raise ConfigError(f"the safetensors file {path} holds no tensor bytes")
    return total


def folder_checkpoint(folder: Path) -> CheckpointSize | None:
    """The checkpoint in ``folder``: its index, else its single safetensors file, else
    ``None``."""
    index = folder / INDEX_FILE
    if index.is_file():
        return CheckpointSize(total_bytes=_index_total(index), path=index, kind="safetensors index")
    single = folder / SINGLE_FILE
    if single.is_file():
        return CheckpointSize(
            total_bytes=_header_total(single), path=single, kind="safetensors header"
        )
    return None


def hub_checkpoint(repo_id: str, revision: str | None, cache: Path) -> CheckpointSize | None:
    """The checkpoint metadata of ``repo_id`` cached in the hub cache ``cache`` (through
    ``huggingface_hub``'s cache lookup; nothing is downloaded), else ``None``."""
    from huggingface_hub import try_to_load_from_cache

    for filename, reader, kind in (
        (INDEX_FILE, _index_total, "safetensors index"),
        (SINGLE_FILE, _header_total, "safetensors header"),
    ):
        found = try_to_load_from_cache(repo_id, filename, cache_dir=cache, revision=revision)
        if isinstance(found, str):
            path = Path(found)
            return CheckpointSize(total_bytes=reader(path), path=path, kind=kind)
    return None
