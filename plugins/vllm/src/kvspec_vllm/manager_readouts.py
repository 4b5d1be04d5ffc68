"""What vLLM 0.32's scheduler reads from its KV-cache manager without changing anything, for
kvspec's manager (:mod:`kvspec_vllm.manager`): block tables as vLLM's ``KVCacheBlocks``,
usage and prefix-cache stats, and the per-step hand-offs that stay empty on kvspec's
allocator (no zeroing, no copy-on-write, no Mamba states).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec_core.runtime import KVCacheAllocator
from kvspec_vllm.manager_views import CoordinatorView


class KVCacheManagerReadouts:
    """The read-only part of :class:`~kvspec_vllm.manager.KVSpecKVCacheManager`, over the
    attributes its constructor sets."""

    allocator: KVCacheAllocator
    coordinator: CoordinatorView
    enable_caching: bool
    log_stats: bool
    prefix_cache_stats: Any
    num_kv_cache_groups: int
    empty_kv_cache_blocks: Any
    # vLLM's KVCacheBlocks class, its PrefixCacheStats class, and one KVCacheBlock per block.
    _kv_cache_blocks: Any
    _prefix_cache_stats_cls: Any
    _blocks: list[Any]

    # ----------------------------------------------------------------- block tables
    def _blocks_of(self, block_ids: Sequence[Sequence[int]]) -> Any:
        blocks = self._blocks
        return self._kv_cache_blocks(tuple([blocks[i] for i in ids] for ids in block_ids))

    def get_blocks(self, request_id: str) -> Any:
        if not self.allocator.is_running(request_id):
            return self.empty_kv_cache_blocks
        return self._blocks_of(self.allocator.block_ids(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if not self.allocator.is_running(request_id):
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(list(ids) for ids in self.allocator.block_ids(request_id))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Cascade attention is gone from vLLM 0.32: 0 per group, as vLLM answers."""
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        return self._kv_cache_blocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ----------------------------------------------------------------- stats
    @property
    def usage(self) -> float:
        """Share of the usable blocks held by requests (cached free blocks count as free)."""
        return self.allocator.usage.fraction

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._prefix_cache_stats_cls()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of ``request`` its cached blocks cover (what vLLM reports as cache
        creation): the full blocks of its computed, known tokens, 0 without caching."""
        rid = request.request_id
        if not self.enable_caching or not self.allocator.is_running(rid):
            return 0
        known = min(self.allocator.num_computed_tokens(rid), request.num_tokens)
        return min(
            known // group.block_size * group.block_size
            for group in self.coordinator.single_type_managers
        )

    # ----------------------------------------------------------------- per-step hand-offs
    def take_new_block_ids(self) -> list[int]:
        """No block needs zeroing (Mamba and mixed precision are refused)."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """No copy-on-write: kvspec's hits end on block boundaries."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """No Mamba boundary states."""
        return {}
