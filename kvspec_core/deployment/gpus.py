"""The GPU catalog (``gpus.json``, data beside this module): each GPU's total memory as
nvidia-smi reports it, and where that figure comes from."""

from __future__ import annotations

import difflib
import functools
import json
from importlib import resources
from typing import Any

import attrs

from kvspec_core.errors import ConfigError

#: Bytes in one MiB: nvidia-smi reports memory in MiB (2**20 bytes).
MIB = 2**20
_CATALOG_FILE = "gpus.json"


@attrs.frozen(kw_only=True)
class GpuModel:
    """One GPU the catalog knows.

    Attributes:
        name: the catalog name (``h100-80gb``), as ``--gpu`` takes it.
        description: the board's full name.
        memory_bytes: total memory in bytes (nvidia-smi's MiB figure times 2**20).
        source: where the figure was read.
    """

    name: str
    description: str
    memory_bytes: int
    source: str


def _entry(name: str, entry: Any) -> GpuModel:
    if not isinstance(entry, dict):
        raise ConfigError(f"GPU catalog entry {name!r} is not an object")
    mib = entry.get("memory_mib")
    if type(mib) is not int or mib <= 0:
        raise ConfigError(f"GPU catalog entry {name!r}: memory_mib must be a positive integer")
    for field in ("description", "source"):
        if not isinstance(entry.get(field), str) or not entry[field]:
            raise ConfigError(f"GPU catalog entry {name!r}: {field} must be a non-empty string")
    return GpuModel(
        name=name,
        description=entry["description"],
        memory_bytes=mib * MIB,
        source=entry["source"],
    )


@functools.cache
def gpu_catalog() -> dict[str, GpuModel]:
    """Every GPU in the catalog, by name (read once, checked)."""
    text = resources.files("kvspec_core.deployment").joinpath(_CATALOG_FILE).read_text("utf-8")
    document = json.loads(text)
    return {name: _entry(name, entry) for name, entry in document["gpus"].items()}


def find_gpu(name: str) -> GpuModel:
    """The catalog's GPU ``name`` (case-insensitive), or an error listing the known ones."""
    catalog = gpu_catalog()
    key = name.strip().lower()
    if key in catalog:
        return catalog[key]
    close = difflib.get_close_matches(key, list(catalog), n=3, cutoff=0.5)
    hint = f"; close: {', '.join(close)}" if close else ""
    raise ConfigError(
        f"--gpu {name!r} is not in the GPU catalog{hint}. Known GPUs: {', '.join(catalog)}; "
        "for another GPU pass --gpu-memory with its total memory (nvidia-smi's figure, e.g. "
        "81559MiB) instead of --gpu"
    )
