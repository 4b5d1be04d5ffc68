"""The engine-facing block allocator with prefix caching, generic over families.

Typical engine loop::

    allocator = KVCacheAllocator.from_plan(plan, manager)
    prefix = allocator.find_cached_prefix(request)            # on admission
    result = allocator.allocate_slots(request, len(request.token_ids) - prefix.num_tokens,
                                      prefix=prefix)
    if not result:                                            # NotNow: queue, retry later
        ...
    request.append_token(token); allocator.allocate_slots(request, 1)   # each decode step
    allocator.decode_step(request_ids, sampled_tokens)        # or a whole decode step
    allocator.free(request.request_id)                       # when it finishes

Design: block tables are plain int lists per group, ref counts a flat array (see
:mod:`kvspec_core.runtime.pool`). Each running request carries three thresholds (the next
total length that needs a new block, the next known length that completes a cacheable
block, the next computed length that frees blocks), so most decode steps are three integer
comparisons; only steps that cross a threshold consult the family rules.

This module assembles the allocator and holds its construction and queries; each job is a
base class in a module of its own (``base.py`` says why base classes): ``stepping.py``
(``allocate_slots``, ``allocate_step``, ``decode_step``), ``admission.py``, ``growth.py``,
``block_caching.py`` (what both do around the blocks they take), ``prefix_lookup.py``,
``fast_paths.py`` (the compiled kernels), ``freeing.py``, ``invariants.py``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvspec_core.context import SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.coordinator import PrefixCoordinator
from kvspec_core.runtime.events import KVCacheEvent
from kvspec_core.runtime.fast_paths import CompiledFastPaths
from kvspec_core.runtime.hashing import PrefixHasher
from kvspec_core.runtime.invariants import InvariantChecks
from kvspec_core.runtime.offloading import TierManager
from kvspec_core.runtime.pool import DEFAULT_EVICTION, BlockPool
from kvspec_core.runtime.results import Allocated, Usage
from kvspec_core.runtime.rules import (
    FullAttentionRules,
    caches_prompt_only,
    overrides_on_instance,
    rules_for,
    rules_plugin,
)
from kvspec_core.runtime.running import _is_id, _Running
from kvspec_core.runtime.tier_transfers import TierTransfers
from kvspec_core.runtime.tiers import OffloadTier
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.encoder import CrossAttentionSpec

if TYPE_CHECKING:
    from kvspec_core.plugins.manager import PluginManager


class KVCacheAllocator(CompiledFastPaths, TierTransfers, InvariantChecks):
    """Block allocator with prefix caching over one or more KV-cache groups and pools.

    Args:
        specs: one spec per KV-cache group (its block size is the group's block size).
        num_blocks: blocks per pool (null block included), one int per pool or one int.
        ctx: the workload limits the plan was made with (admission caps, DCP, Mamba mode).
        pool_of_group: pool index of each group (default: all groups share pool 0).
        manager: where plugin rules come from (default: a manager with installed plugins).
        enable_prefix_caching: find and record cached prefixes.
        hash_block_size: prefix hashing granularity; must divide every group's block
            (default: their gcd, so large pages never coarsen reuse of smaller ones).
        enable_kv_events: record :mod:`~kvspec_core.runtime.events` for :meth:`take_events`.
        hash_salt: fixed salt instead of the per-process random one (tests, replays).
        eviction: ``"lru"`` (default, vLLM's order) or ``"segmented"`` (reused prefixes
            outlive one-off blocks); see :mod:`kvspec_core.runtime.pool`.
        offload_tiers: tiers below the device, fastest first (host memory, then disk):
            cached blocks the device evicts are offloaded there instead of lost, and
            lookups find prefixes across tiers (see the runtime README, "Offload tiers").
            Without tiers the allocator is exactly the single-tier one.
    """

    def __init__(
        self,
        specs: Sequence[KVSpec],
        num_blocks: int | Sequence[int],
        ctx: SizingContext,
        *,
        pool_of_group: Sequence[int] | None = None,
        manager: PluginManager | None = None,
        enable_prefix_caching: bool = True,
        hash_block_size: int | None = None,
        enable_kv_events: bool = False,
        hash_salt: bytes | None = None,
        eviction: str = DEFAULT_EVICTION,
        offload_tiers: Sequence[OffloadTier] = (),
    ) -> None:
        if not specs:
            raise AllocatorError("KVCacheAllocator needs at least one KV-cache group spec")
        for index, spec in enumerate(specs):
            if not isinstance(spec, KVSpec):
                raise AllocatorError(f"group {index}: {spec!r} is not a KVSpec")
        if not isinstance(ctx, SizingContext):
            raise AllocatorError(f"ctx={ctx!r} must be a kvspec_core.SizingContext")
        pool_sizes = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        pools_of = list(pool_of_group) if pool_of_group is not None else [0] * len(specs)
        if len(pools_of) != len(specs):
            raise AllocatorError(
                f"pool_of_group has {len(pools_of)} entries for {len(specs)} groups"
            )
        for index, pool in enumerate(pools_of):
            if not isinstance(pool, int) or not 0 <= pool < len(pool_sizes):
                raise AllocatorError(
                    f"group {index} names pool {pool!r}; pools are 0..{len(pool_sizes) - 1}"
                )
        if manager is None:
            from kvspec_core.plugins.manager import load_plugins

            manager = load_plugins()
        self.ctx = ctx
        self.specs = tuple(specs)
        self.max_model_len = ctx.max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._events: list[KVCacheEvent] | None = [] if enable_kv_events else None
        self.pools = [
            BlockPool(
                size,
                [gid for gid, pool in enumerate(pools_of) if pool == index] or [0],
                events=self._events,
                eviction=eviction,
            )
            for index, size in enumerate(pool_sizes)
        ]
        self.rules = [rules_for(spec, ctx, manager) for spec in self.specs]
        self._rules_owners = [rules_plugin(spec, manager) for spec in self.specs]
        self.admission_caps = [spec.max_blocks_per_request(ctx) for spec in self.specs]
        self._pool_of = pools_of
        self._group_pools = [self.pools[pool] for pool in pools_of]
        self._holding = [gid for gid, cap in enumerate(self.admission_caps) if cap > 0]
        # Whether a request's encoder tokens have a group to hold them (cross-attention with
        # max_encoder_tokens > 0); where none does, such a request is refused at admission.
        self._holds_encoder = any(
            isinstance(self.specs[gid], CrossAttentionSpec) for gid in self._holding
        )
        block_tokens = [rules.block_tokens for rules in self.rules]
        holding_tokens = [block_tokens[gid] for gid in self._holding] or [1]
        if hash_block_size is None:
            hash_block_size = math.gcd(*holding_tokens)
        for gid in self._holding:
            if block_tokens[gid] % hash_block_size:
                raise AllocatorError(
                    f"hash_block_size={hash_block_size} must divide group {gid}'s block of "
                    f"{block_tokens[gid]} tokens ({self.specs[gid].kind}); use a divisor of "
                    f"{math.gcd(*holding_tokens)}"
                )
        self.hash_block_size = hash_block_size
        self._hasher = PrefixHasher(hash_block_size, hash_salt)
        self._block_tokens = block_tokens
        self._hash_stride = [tokens // hash_block_size for tokens in block_tokens]
        self._caches = [
            self._group_pools[gid].caches.setdefault(gid, {}) for gid in range(len(specs))
        ]
        self._cacheable = self.enable_prefix_caching and all(
            self.rules[gid].prefix_cacheable for gid in self._holding
        )
        self._coordinator = PrefixCoordinator(
            self.rules, self._holding, self._hash_stride, self._caches
        )
        tiers = tuple(offload_tiers)
        for index, tier in enumerate(tiers):
            if not isinstance(tier, OffloadTier):
                raise AllocatorError(
                    f"offload_tiers[{index}]={tier!r} must be a kvspec_core.runtime.OffloadTier"
                )
        if tiers and not self._cacheable:
            raise AllocatorError(
                "offload tiers keep the prefix-cache blocks the device evicts, but "
                f"{self._why_nothing_is_cached()}, so the tiers would stay empty: leave "
                "offload_tiers out"
            )
        self._tiers = (
            TierManager(
                tiers,
                self.pools,
                pools_of,
                self._caches,
                self.rules,
                self._coordinator.hit_scans,
            )
            if tiers
            else None
        )
        if self._tiers is not None and self._events is not None:
            self._tiers.on_loaded = self._record_loaded
        # Groups whose rules are plugin code: checked before a step changes anything. Per
        # guarded group, which of the methods a step asks afterwards are plugin code (a
        # method inherited from the core's full-attention rules cannot raise: not asked twice).
        self._guarded = [gid for gid in self._holding if self._rules_owners[gid] is not None]
        self._guarded_methods = {
            gid: frozenset(
                name
                for name in ("next_allocation_end", "next_skip_position", "cache_range")
                if getattr(type(self.rules[gid]), name, None)
                is not getattr(FullAttentionRules, name)
            )
            for gid in self._guarded
        }
        self._is_state_group = [
            gid in self._coordinator.state_groups for gid in range(len(self.specs))
        ]
        # Groups caching only the blocks inside a request's prompt (R-SWA's rules).
        self._prompt_only = [caches_prompt_only(rules) for rules in self.rules]
        # Every holding group keeps all its blocks and caches them as they fill (the core's
        # full-attention rules, not a subclass) and no events are recorded: decode steps
        # that cross a block boundary take the short path of _grow_dense.
        self._dense = self._events is None and all(
            type(self.rules[gid]) is FullAttentionRules
            and not overrides_on_instance(self.rules[gid])
            and not self._prompt_only[gid]
            for gid in self._holding
        )
        # One full-attention group whose blocks are hash blocks: find_cached_prefix asks it
        # directly, and the compiled fast path may take its block-boundary steps.
        self._single_full = (
            self._dense
            and len(self.specs) == 1
            and self._holding == [0]
            and self._hash_stride == [1]
        )
        # Hash blocks finer than every group's block: the general path hashes each one as
        # it completes, before any group block is full.
        self._hash_finer = min((self._hash_stride[gid] for gid in self._holding), default=1) > 1
        self._running: dict[str | int, _Running] = {}
        self._freed: OrderedDict[str | int, None] = OrderedDict()
        # Per request id, the last prefix with a hit find_cached_prefix handed out, as
        # (prefix, request, num_tokens, block_ids, epochs): the very objects, so an admission
        # with it unchanged (identity; no frozen field replaced) skips the per-block check.
        self._handed_out: dict[str | int, tuple[Any, ...]] = {}
        self._no_new_blocks = Allocated(new_block_ids=tuple(() for _ in self.specs))
        self._use_compiled_kernels()

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_plan(
        cls,
        plan: Any,
        manager: PluginManager | None = None,
        ctx: SizingContext | None = None,
        **options: Any,
    ) -> KVCacheAllocator:
        """An allocator for a planner plan (``plan.groups[i].spec / .block_size / .pool``,
        ``plan.pools[i].num_blocks``); ``ctx`` defaults to the plan's own context."""
        if ctx is None:
            ctx = getattr(plan, "context", None) or getattr(plan, "ctx", None)
        if ctx is None:
            raise AllocatorError("from_plan needs the SizingContext the plan was made with")
        specs = []
        pools = []
        for group in plan.groups:
            spec = group.spec
            block_size = getattr(group, "block_size", spec.block_size)
            if block_size != spec.block_size:
                spec = spec.with_block_size(block_size)
            specs.append(spec)
            pools.append(int(getattr(group, "pool", 0)))
        sizes = [int(pool.num_blocks) for pool in plan.pools]
        allocator = cls(specs, sizes, ctx, pool_of_group=pools, manager=manager, **options)
        for index, group in enumerate(plan.groups):
            planned = getattr(group, "blocks_per_request", None)
            if planned is not None and planned != allocator.admission_caps[index]:
                raise AllocatorError(
                    f"plan group {index} ({group.spec.kind}) was sized for {planned} blocks per "
                    f"request but its spec admits {allocator.admission_caps[index]} under this "
                    "context; build the allocator with the context the plan was made with"
                )
        return allocator

    # ----------------------------------------------------------------- queries
    @property
    def usage(self) -> Usage:
        """Blocks in use, free and cached, over all pools."""
        return Usage(
            used_blocks=sum(pool.num_used_blocks for pool in self.pools),
            free_blocks=sum(pool.num_free_blocks for pool in self.pools),
            cached_blocks=sum(pool.num_cached_blocks for pool in self.pools),
            usable_blocks=sum(pool.num_usable_blocks for pool in self.pools),
        )

    @property
    def no_new_blocks(self) -> Allocated:
        """What :meth:`allocate_slots` returns when a step needs no new block (the same
        object every time, so ``result is allocator.no_new_blocks`` is a cheap test)."""
        return self._no_new_blocks

    @property
    def num_running(self) -> int:
        return len(self._running)

    def is_running(self, request_id: str | int) -> bool:
        return _is_id(request_id) and request_id in self._running

    def block_ids(self, request_id: str | int) -> tuple[tuple[int, ...], ...]:
        """The request's block table per group (``0`` marks null entries)."""
        return tuple(tuple(blocks) for blocks in self._state(request_id).blocks)

    def num_computed_tokens(self, request_id: str | int) -> int:
        return self._state(request_id).computed

    def take_events(self) -> list[KVCacheEvent]:
        """KV events recorded since the last call (empty unless ``enable_kv_events``)."""
        if self._events is None:
            return []
        events = list(self._events)
        self._events.clear()
        return events

    def _why_nothing_is_cached(self) -> str:
        """Why no prefix is ever cached (prefix caching off, or a group that caches none)."""
        if not self.enable_prefix_caching:
            return "enable_prefix_caching=False"
        gid = next(gid for gid in self._holding if not self.rules[gid].prefix_cacheable)
        return (
            f"group {gid} ({self.specs[gid].kind}) caches no prefix (its family's rules), so "
            "no prefix of this model is ever a hit"
        )
