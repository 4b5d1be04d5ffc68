"""Shadow mode: vLLM's own KV-cache manager runs the engine, and every call the scheduler
makes to it is mirrored into kvspec's :class:`~kvspec_core.runtime.KVCacheAllocator`, which
answers independently; any difference in prefix hits, admissions or free blocks is
reported. A conformance tool for engine builders: it shows where kvspec's allocator would
decide as vLLM's does on a real workload, and where not, without touching the engine's
outputs (vLLM's answers are the ones returned).

Switched on with ``KVSPEC_VLLM_SHADOW=1`` (the plugin wraps the ``KVCacheManager`` vLLM's
scheduler builds), or by hand with :func:`shadow_manager`. Mirrored: ``get_computed_blocks``
(kvspec's ``find_cached_prefix`` on the same tokens: equal hit tokens?),
``allocate_slots`` (the same span of tokens: both admit or both refuse? then equal free
blocks?) and ``free`` / ``pop_blocks_for_free``. Requests whose tokens come from a KV
connector (external tokens, delayed caching) are not mirrored; a request vLLM admitted and
kvspec refused is left out from then on (both counted as differences). The manager of an
``AsyncScheduler`` is not mirrored at all, with a warning
(:data:`ASYNC_SCHEDULING_NOT_MIRRORED`).

Each difference is classified (:mod:`kvspec_vllm.shadow_differences`): *expected* ones come
from policies where vLLM 0.32 and kvspec differ and both are right (copies of a recomputed
cached block, vLLM's sparse sliding-window retention, and what follows from them), are
counted per reason and logged at INFO; the others are *divergences*, logged as warnings and
kept in :attr:`ShadowReport.differences`.

The parts: :mod:`kvspec_vllm.shadow_mirror` (the mirror and its comparisons),
:mod:`kvspec_vllm.shadow_report` (the report and how a difference is recorded),
:mod:`kvspec_vllm.shadow_differences` (the classifier) and :mod:`kvspec_vllm.shadow_install`
(wrapping a manager, and vLLM's scheduler); every name is importable from here.
"""

from __future__ import annotations

import logging

from kvspec_vllm.shadow_install import (
    ASYNC_SCHEDULING_NOT_MIRRORED,
    allocator_for,
    install,
    shadow_manager,
    shadows,
    uninstall,
)
from kvspec_vllm.shadow_mirror import KVCacheShadow
from kvspec_vllm.shadow_report import (
    MAX_KEPT_DIFFERENCES,
    MAX_LOGGED_DIFFERENCES,
    ShadowReport,
)

#: The logger every shadow module writes to (a handler added here sees all of them).
logger = logging.getLogger("vllm.kvspec.shadow")

__all__ = [
    "ASYNC_SCHEDULING_NOT_MIRRORED",
    "MAX_KEPT_DIFFERENCES",
    "MAX_LOGGED_DIFFERENCES",
    "KVCacheShadow",
    "ShadowReport",
    "allocator_for",
    "install",
    "logger",
    "shadow_manager",
    "shadows",
    "uninstall",
]
