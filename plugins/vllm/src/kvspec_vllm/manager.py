"""kvspec's :class:`~kvspec_core.runtime.KVCacheAllocator` behind vLLM 0.32's scheduler.

:class:`KVSpecKVCacheManager` has the surface of vLLM's ``KVCacheManager`` that the
scheduler (``vllm/v1/core/sched/scheduler.py``) calls in a plain generate run, and answers
every call from kvspec's allocator: prefix lookups (``get_computed_blocks`` ->
``find_cached_prefix``), admissions and steps (``allocate_slots``), frees and preemptions
(``free``), block tables (``get_blocks``), usage, prefix-cache stats, KV events (with vLLM's
block hashes, :mod:`kvspec_vllm.manager_events`) and ``reset_prefix_cache``. The block ids
it hands out index the KV-cache tensors of the ``KVCacheConfig`` the scheduler was given
(kvspec's plan with ``KVSPEC_VLLM=1``, else vLLM's own): kvspec's pool has that config's
``num_blocks`` blocks, block 0 the null block as in vLLM.

Covered: full-attention and sliding-window groups (Gemma 2's mix too) sharing one pool,
prefix caching (on or off; the cache salt and the LoRA adapter's name and path in the
hashes), preemption and resumption, chunked prefill, vLLM's full-sequence admission gate
(``scheduler_reserve_full_isl``), KV events. What the scheduler reaches beyond that raises
:class:`~kvspec_vllm.manager_views.NotCovered` naming it; what a configuration would need
that this does not cover is refused when the scheduler is built
(:mod:`kvspec_vllm.scheduler_seam`).

This module holds the calls that change kvspec's allocator; the rest is in
:mod:`kvspec_vllm.manager_coverage` (the scheduler features, groups and requests refused),
:mod:`kvspec_vllm.manager_admission` (the prefix a request is admitted with, the
full-sequence gate), :mod:`kvspec_vllm.manager_readouts` (block tables, usage, stats, the
empty per-step hand-offs), :mod:`kvspec_vllm.manager_events` and
:mod:`kvspec_vllm.manager_views` (the coordinator and block pool vLLM reads).
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from kvspec_core.context import SizingContext
from kvspec_core.runtime import CachedPrefix, KVCacheAllocator, Request
from kvspec_core.runtime.results import NO_FREE_BLOCKS, STALE_PREFIX, NotNow
from kvspec_vllm.errors import KVSpecVLLMError
from kvspec_vllm.manager_admission import admission_prefix, full_sequence_fits
from kvspec_vllm.manager_coverage import (
    COVERED_KINDS,
    check_scheduler_features,
    covered_specs,
    kvspec_request_of,
)
from kvspec_vllm.manager_events import EventTranslator
from kvspec_vllm.manager_readouts import KVCacheManagerReadouts
from kvspec_vllm.manager_views import (
    BlockPoolView,
    CoordinatorView,
    GroupView,
    NotCovered,
    not_covered,
)
from kvspec_vllm.specs import vllm_module

logger = logging.getLogger("vllm.kvspec.manager")


class KVSpecKVCacheManager(KVCacheManagerReadouts):
    """vLLM's ``KVCacheManager`` surface over kvspec's allocator (same constructor
    arguments, so the scheduler builds it in place of vLLM's).

    ``allocator`` is kvspec's allocator; ``num_lookups`` / ``num_allocations`` count the
    scheduler's calls (what a test reads to see the scheduler ran on it).
    """

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        check_scheduler_features(
            kv_cache_config,
            use_eagle=use_eagle,
            num_prefill_lookahead=num_prefill_lookahead,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            watermark=watermark,
        )
        if metrics_collector is not None:
            logger.warning(
                "kvspec-vllm: vLLM's KV-cache residency metrics are not fed by kvspec's "
                "allocator (kv_cache_metrics); the metrics stay empty"
            )
        interface = vllm_module("vllm.v1.kv_cache_interface")
        groups = kv_cache_config.kv_cache_groups
        specs = covered_specs(groups, hash_block_size)
        ctx = SizingContext(
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens or max_model_len,
            prefix_caching=bool(enable_caching),
        )
        self.allocator = KVCacheAllocator(
            specs,
            kv_cache_config.num_blocks,
            ctx,
            enable_prefix_caching=bool(enable_caching),
            hash_block_size=hash_block_size,
            enable_kv_events=bool(enable_kv_cache_events),
        )
        utils = vllm_module("vllm.v1.core.kv_cache_utils")
        manager_module = vllm_module("vllm.v1.core.kv_cache_manager")
        stats = vllm_module("vllm.v1.metrics.stats")
        self._kv_cache_blocks = manager_module.KVCacheBlocks
        self._prefix_cache_stats_cls = stats.PrefixCacheStats
        self._blocks = [
            utils.KVCacheBlock(block_id) for block_id in range(kv_cache_config.num_blocks)
        ]
        self._blocks[0].is_null = True
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.use_eagle = False
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: Any = stats.PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = 0
        self.empty_kv_cache_blocks = self._kv_cache_blocks(tuple(() for _ in groups))
        self.coordinator = CoordinatorView(
            [
                GroupView(group.kv_cache_spec, group.kv_cache_spec.block_size, index)
                for index, group in enumerate(groups)
            ]
        )
        self.block_pool = BlockPoolView(self.allocator, self._blocks)
        self._events = (
            EventTranslator(
                [
                    (
                        interface.get_kv_cache_spec_kind(group.kv_cache_spec).value,
                        interface.get_kv_cache_spec_sliding_window(group.kv_cache_spec),
                    )
                    for group in groups
                ]
            )
            if enable_kv_cache_events
            else None
        )
        self._pending_events: list[Any] = []
        # vLLM request id -> kvspec's view of it (shares vLLM's token list), from its first
        # lookup until it finishes; and the prefix its last lookup found, until admitted.
        self._mirrors: dict[str, Request] = {}
        self._prefixes: dict[str, CachedPrefix] = {}
        self.num_lookups = 0
        self.num_allocations = 0
        logger.info(
            "kvspec-vllm: vLLM's scheduler runs on kvspec's KVCacheAllocator (%d blocks, "
            "groups %s, prefix caching %s)",
            kv_cache_config.num_blocks,
            ", ".join(spec.kind for spec in specs),
            "on" if enable_caching else "off",
        )

    # ----------------------------------------------------------------- requests
    def _mirror(self, request: Any) -> Request:
        rid = request.request_id
        mirror = self._mirrors.get(rid)
        if mirror is not None and mirror.token_ids is request._all_token_ids:
            return mirror
        mirror = kvspec_request_of(request)
        self._mirrors[rid] = mirror
        return mirror

    # ----------------------------------------------------------------- the scheduler's calls
    def new_step_starts(self) -> None:
        """Nothing to do at a step's start (vLLM's managers reset per-step counters)."""

    def get_computed_blocks(self, request: Any) -> tuple[Any, int, int]:
        """kvspec's longest cached prefix of ``request``: its blocks, its tokens, and 0 (no
        shared-prefix junction: that is for Mamba)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        rid = request.request_id
        prefix = self.allocator.find_cached_prefix(self._mirror(request))
        self.num_lookups += 1
        if not prefix.num_tokens:
            self._prefixes.pop(rid, None)
            return self.empty_kv_cache_blocks, 0, 0
        self._prefixes[rid] = prefix
        if (
            self._events is not None
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            # A router asking for the whole prefix: the reused blocks too, as vLLM reports.
            self._pending_events.extend(
                self._events.reused(
                    request,
                    [len(ids) for ids in prefix.block_ids],
                    [group.block_size for group in self.coordinator.single_type_managers],
                )
            )
        return self._blocks_of(prefix.block_ids), prefix.num_tokens, 0

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Slots for ``num_new_tokens`` more tokens of ``request`` (admitting it with the
        prefix :meth:`get_computed_blocks` found, when it is not running): the new blocks,
        or ``None`` when kvspec's pool is short (the scheduler then preempts or waits)."""
        if num_external_computed_tokens or delay_cache_blocks or reserved_blocks:
            not_covered("allocate_slots with external tokens", "a KV connector")
        if num_encoder_tokens:
            not_covered("allocate_slots with encoder tokens", "an encoder-decoder model")
        rid = request.request_id
        allocator = self.allocator
        self.num_allocations += 1
        if allocator.is_running(rid):
            computed = allocator.num_computed_tokens(rid)
            if num_new_computed_tokens or computed != request.num_computed_tokens:
                raise KVSpecVLLMError(
                    f"kvspec-vllm: request {rid!r} has {request.num_computed_tokens} computed "
                    f"tokens in vLLM's scheduler, {computed} in kvspec's allocator (with "
                    f"{num_new_computed_tokens} new cached ones): the scheduler rolled tokens "
                    "back or skipped a step, which kvspec's allocator does not follow"
                )
            # A request holding blocks meets the gate too: a streaming-input session's next
            # chunk (its blocks kept between turns) waits while its whole sequence cannot fit.
            if full_sequence_must_fit and not full_sequence_fits(
                allocator, request, None, self.max_model_len
            ):
                return None
            mirror = self._mirrors[rid]
            result = allocator.allocate_slots(mirror, num_new_tokens, num_lookahead_tokens)
        else:
            prefix = admission_prefix(
                allocator,
                request,
                num_new_computed_tokens,
                self._prefixes.pop(rid, None),
                self.num_kv_cache_groups,
            )
            if full_sequence_must_fit and not full_sequence_fits(
                allocator, request, prefix, self.max_model_len
            ):
                return None
            result = allocator.allocate_slots(
                self._mirror(request), num_new_tokens, num_lookahead_tokens, prefix=prefix
            )
        self._collect_events(request)
        if isinstance(result, NotNow):
            if result.reason in (NO_FREE_BLOCKS, STALE_PREFIX):
                # Not now: the scheduler preempts, or retries (a stale prefix is looked up
                # again at the request's next admission).
                return None
            raise KVSpecVLLMError(f"kvspec-vllm: request {rid!r}: {result.message}")
        if result is allocator.no_new_blocks:
            return self.empty_kv_cache_blocks
        return self._blocks_of(result.new_block_ids)

    def free(self, request: Any) -> None:
        """Release the request's blocks (a finish, an abort or a preemption); a finished
        request is forgotten, a preempted one keeps its hashes for its resumption."""
        rid = request.request_id
        self._prefixes.pop(rid, None)
        if self.allocator.is_running(rid):
            self.allocator.free(rid)
            self._collect_events(None)
        if request.is_finished():
            self._mirrors.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's manager does only when no request holds
        blocks (``False`` otherwise, nothing changed)."""
        if self.allocator.num_running:
            logger.warning(
                "kvspec-vllm: prefix cache not reset: %d requests still hold blocks",
                self.allocator.num_running,
            )
            return False
        self.allocator.reset_prefix_cache()
        self._collect_events(None)
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[Any]:
        """vLLM's KV events for what kvspec's pool cached and evicted since the last call."""
        events = self._pending_events
        self._pending_events = []
        return events

    def _collect_events(self, request: Any) -> None:
        if self._events is None:
            return
        events = self.allocator.take_events()
        if events:
            mirror = self._mirrors.get(request.request_id) if request is not None else None
            hashes = mirror.block_hashes if mirror is not None else []
            self._pending_events.extend(self._events.translate(events, request, hashes))

    def __getattr__(self, name: str) -> NoReturn:
        # Only names the class does not define: KV-connector and Mamba paths
        # (get_computed_blocks_for_connector, cache_blocks, pop_blocks_for_free,
        # remove_skipped_blocks, evict_blocks, truncate_computed_blocks, ...).
        if name.startswith("__"):
            raise AttributeError(name)
        not_covered(f"KVCacheManager.{name}", "a KV connector, asynchronous scheduling or Mamba")


__all__ = ["COVERED_KINDS", "KVSpecKVCacheManager", "NotCovered"]
