"""What vLLM 0.32's scheduler and engine core reach past ``KVCacheManager``'s methods, for
kvspec's manager (:mod:`kvspec_vllm.manager`): ``coordinator.single_type_managers`` (read at
scheduler and engine start for block sizes and specs), ``block_pool`` (free-block counts),
and the ``KVCacheBlock`` objects the scheduler hands the model runner.

Anything else there is reached only by features the allocator does not cover (KV
connectors, speculative decoding, Mamba, copy-on-write partial hits): those raise
:class:`NotCovered`, naming the attribute and the way out, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import attrs

from kvspec_core.runtime import KVCacheAllocator
from kvspec_vllm.errors import KVSpecVLLMError

#: The switch named in every refusal (kept here, not imported, so this module stays a leaf).
_SWITCH = "KVSPEC_VLLM_ALLOCATOR"


class NotCovered(KVSpecVLLMError, AttributeError):
    """vLLM reached a part of its KV-cache manager that kvspec's allocator does not provide
    (an ``AttributeError`` too, so ``hasattr`` / ``getattr(..., default)`` behave)."""


def not_covered(what: str, feature: str) -> NoReturn:
    """Raise :class:`NotCovered` for ``what`` (the attribute or call) used by ``feature``."""
    raise NotCovered(
        f"kvspec-vllm: vLLM's scheduler reached {what} ({feature}), which kvspec's allocator "
        f"behind the scheduler does not cover. Unset {_SWITCH} to run vLLM's own KV-cache "
        "manager for this configuration"
    )


@attrs.frozen
class GroupView:
    """One KV-cache group as vLLM's ``SingleTypeKVCacheManager`` shows it to the scheduler
    and engine core: its spec, block size and index."""

    kv_cache_spec: Any
    block_size: int
    kv_cache_group_id: int


class CoordinatorView:
    """The parts of vLLM's ``KVCacheCoordinator`` a plain generate run reads."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0
    eagle_group_ids: tuple[int, ...] = ()

    def __init__(self, groups: Sequence[GroupView]) -> None:
        self.single_type_managers = tuple(groups)

    def get_num_blocks_to_allocate(self, *args: Any, **kwargs: Any) -> NoReturn:
        not_covered(
            "coordinator.get_num_blocks_to_allocate", "reservations for asynchronous KV loads"
        )

    def __getattr__(self, name: str) -> NoReturn:
        not_covered(f"coordinator.{name}", "a feature beyond full and sliding-window attention")


class BlockPoolView:
    """The parts of vLLM's ``BlockPool`` a plain generate run reads, from kvspec's pool."""

    def __init__(self, allocator: KVCacheAllocator, blocks: Sequence[Any]) -> None:
        self._allocator = allocator
        self.num_gpu_blocks = len(blocks)
        self.null_block = blocks[0]
        self.enable_caching = allocator.enable_prefix_caching

    def get_num_free_blocks(self) -> int:
        return self._allocator.usage.free_blocks

    def get_usage(self) -> float:
        return self._allocator.usage.fraction

    def free_blocks(self, blocks: Any) -> NoReturn:
        not_covered(
            "block_pool.free_blocks",
            "deferred frees of a KV connector, or copy-on-write partial hits",
        )

    def __getattr__(self, name: str) -> NoReturn:
        not_covered(f"block_pool.{name}", "a feature beyond full and sliding-window attention")
