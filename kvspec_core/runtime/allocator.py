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
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvspec_core.context import SizingContext
from kvspec_core.errors import AllocatorError, KVSpecError
from kvspec_core.runtime.coordinator import PrefixCoordinator
from kvspec_core.runtime.events import AllBlocksCleared, BlockStored, KVCacheEvent
from kvspec_core.runtime.hashing import _INT_ONLY, PrefixHasher, _describe
from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import DEFAULT_EVICTION, BlockPool
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import (
    NO_FREE_BLOCKS,
    OVER_ADMISSION_CAP,
    STALE_PREFIX,
    Allocated,
    CachedPrefix,
    NotNow,
    Usage,
)
from kvspec_core.runtime.rules import (
    NEVER,
    FullAttentionRules,
    compiled_shape,
    plugin_rules_error,
    rules_for,
    rules_plugin,
)
from kvspec_core.specs.base import KVSpec

if TYPE_CHECKING:
    from kvspec_core.plugins.manager import PluginManager

#: Request ids remembered after ``free`` so a second ``free`` says "already freed".
_FREED_MEMORY = 4096

#: Prefixes handed out and not yet admitted that an admission trusts without a per-block
#: check (see ``_check_prefix``); past this many, forgotten (their admissions check them).
_HANDED_OUT_KEPT = 4096

#: What an admission runs: a subclass overriding one of them admits through its Python code.
_ADMISSION_METHODS = ("_admit", "_admit_checked", "_check_counts", "_check_prefix",
                      "_preflight", "_cache_new_blocks", "_update_limits", "_shortfall")


def _is_id(request_id: object) -> bool:
    """Whether ``request_id`` is an exact str or int: what the allocator keys requests by.
    Looking another object up could run its ``__hash__`` / ``__eq__`` in the middle of a
    step (and a NaN is not equal to itself)."""
    kind = request_id.__class__
    return kind is str or kind is int


def _id_error(request_id: object, where: str = "") -> str:
    """Why ``request_id`` (not an exact str or int) is refused."""
    kind = request_id.__class__
    described = repr(request_id) if kind is float or kind is bool or kind is bytes \
        else f"<a {kind.__name__}>"
    return (
        f"{where + ': ' if where else ''}request_id={described} must be a str or an int, not "
        f"{kind.__name__}; give each request a unique str (or int) id"
    )


class _Running:
    """Allocator-side state of one running request."""

    __slots__ = (
        "request",
        "computed",
        "blocks",
        "num_skipped",
        "num_real",
        "num_cached",
        "cache_at",
        "end_limit",
        "known_limit",
        "computed_limit",
    )

    def __init__(self, request: Request, computed: int, blocks: list[list[int]]) -> None:
        self.request = request
        self.computed = computed
        self.blocks = blocks
        count = len(blocks)
        self.num_skipped = [0] * count
        self.num_real = [len(table) - table.count(0) for table in blocks]
        self.num_cached = [0] * count
        self.cache_at = [0] * count
        self.end_limit = 0
        self.known_limit = 0
        self.computed_limit = 0


if native is not None:
    # The compiled steps read and write these records' slots in place (and know bare
    # requests); they build Allocated and CachedPrefix results without a Python call.
    native.register_types(_Running, Request, Allocated, CachedPrefix)


class KVCacheAllocator:
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
        # Groups whose rules are plugin code: checked before a step changes anything. Per
        # guarded group, which of the methods a step asks afterwards are plugin code (a
        # method inherited from the core's full-attention rules cannot raise: not asked twice).
        self._guarded = [gid for gid in self._holding if self._rules_owners[gid] is not None]
        self._guarded_methods = {
            gid: frozenset(
                name for name in ("next_allocation_end", "next_skip_position", "cache_range")
                if getattr(type(self.rules[gid]), name, None)
                is not getattr(FullAttentionRules, name)
            )
            for gid in self._guarded
        }
        self._is_state_group = [
            gid in self._coordinator.state_groups for gid in range(len(self.specs))
        ]
        # Every holding group keeps all its blocks and caches them as they fill (the core's
        # full-attention rules, not a subclass) and no events are recorded: decode steps
        # that cross a block boundary take the short path of _grow_dense.
        self._dense = (
            self._events is None
            and all(type(self.rules[gid]) is FullAttentionRules for gid in self._holding)
        )
        # One full-attention group whose blocks are hash blocks: find_cached_prefix asks it
        # directly, and the compiled fast path may take its block-boundary steps.
        self._single_full = (self._dense and len(self.specs) == 1 and self._holding == [0]
                             and self._hash_stride == [1])
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
        if native is not None and type(self).allocate_slots is KVCacheAllocator.allocate_slots:
            # Decode steps that need no block are answered without a Python frame, and so
            # are most block-boundary steps of a one-group full-attention allocator; every
            # other call reaches the method below.
            dense = self._compiled_dense_step()
            groups = self._compiled_group_step()
            self.allocate_slots = native.SlotsFastPath(  # type: ignore[method-assign]
                self._running, self._no_new_blocks, self._allocate_slots, dense,
                None if dense is not None else groups, self._compiled_admission(groups),
            )
            if (dense is not None and len(self.pools) == 1 and self._cacheable
                    and type(self).find_cached_prefix is KVCacheAllocator.find_cached_prefix):
                # Prefix lookups too (every one the kernel does not answer reaches the method).
                self.find_cached_prefix = functools.partial(  # type: ignore[method-assign]
                    native.find_prefix,
                    (self._running, dense[0], self._hasher, self._caches[0], dense[2],
                     self._handed_out),
                    self._find_cached_prefix,
                )

    def _compiled_dense_step(self) -> tuple[Any, ...] | None:
        """What ``native.SlotsFastPath`` needs to do :meth:`_grow_dense` itself, or None
        where the compiled step does not apply: it serves one full-attention group whose
        block is one hash block, in a pool built with the kernels, with the core's own
        allocator, pool and hasher methods (a subclass's override runs as Python)."""
        pool = self._group_pools[0]
        if not (
            self._single_full
            and type(pool) is BlockPool
            and pool._compiled
            and type(self._hasher) is PrefixHasher
            and type(self)._grow_dense is KVCacheAllocator._grow_dense
        ):
            return None
        return (pool, self._hasher, self._block_tokens[0], self.admission_caps[0],
                self.max_model_len, self.hash_block_size, self._cacheable)

    def _compiled_group_step(self) -> tuple[Any, ...] | None:
        """What ``native.SlotsFastPath`` needs to do :meth:`_grow_checked` itself, or None
        where the compiled step does not apply: it serves allocators recording no events
        whose holding groups' rules all keep the step methods of one of the core's
        parametric shapes (:func:`~kvspec_core.runtime.rules.compiled_shape`), each
        group's block one hash block, in pools built with the kernels, with the core's own
        allocator, pool and hasher methods."""
        methods = ("_grow", "_grow_checked", "_grow_dense", "_preflight", "_cache_new_blocks",
                   "_update_limits")
        if (
            self._events is not None
            or not self._holding
            or type(self._hasher) is not PrefixHasher
            or any(getattr(type(self), name) is not getattr(KVCacheAllocator, name)
                   for name in methods)
        ):
            return None
        groups = []
        for gid in self._holding:
            rules = self.rules[gid]
            pool = self._group_pools[gid]
            shape = compiled_shape(rules)
            retained = getattr(rules, "retained_tokens", 0)
            if (
                shape is None
                or type(pool) is not BlockPool
                or not pool._compiled
                or self._hash_stride[gid] != 1
                or retained.__class__ is not int
                or not 0 <= retained < self.max_model_len + 1
            ):
                return None
            groups.append((gid, shape, self._block_tokens[gid], self.admission_caps[gid],
                           retained, self._is_state_group[gid], pool))
        return (self._hasher, self.max_model_len, self.hash_block_size, self._cacheable,
                len(self.specs), tuple(groups))

    def _compiled_admission(self, groups: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        """What ``native.SlotsFastPath`` needs to do :meth:`_admit_checked` itself (the
        allocator's freed ids, :class:`CachedPrefix`, its pools, and ``groups``, what
        :meth:`_compiled_group_step` gave), or None where the compiled admission does not
        apply: where the group steps are not compiled, or a subclass changes how
        admissions are made."""
        if groups is None or any(getattr(type(self), name) is not getattr(KVCacheAllocator, name)
                                 for name in _ADMISSION_METHODS):
            return None
        return (self._freed, CachedPrefix, tuple(self.pools), groups, self._handed_out)

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

    def _state(self, request_id: str | int) -> _Running:
        state = self._running.get(request_id) if _is_id(request_id) else None
        if state is None:
            raise AllocatorError(self._not_running_message(request_id))
        return state

    def _not_running_message(self, request_id: str | int) -> str:
        if not _is_id(request_id):
            return _id_error(request_id)
        if request_id in self._freed:
            return f"request {request_id!r} was already freed (double free)"
        return f"request {request_id!r} is unknown to this allocator (never allocated)"

    # ----------------------------------------------------------------- prefix lookup
    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest prefix of ``request`` that every group can resume from.

        At most ``num_tokens - 1`` tokens (the last prompt token is always computed, to
        produce logits). Each family's rules state what resuming needs; groups are asked in
        turn, each at most the current hit, until none lowers it (a fixed point), so the
        answer never includes a position some group cannot resume from.

        When state groups (Mamba) hold the hit below where the prompt shares cached
        attention content, ``checkpoint_at`` names that position: an engine that ends a
        prefill step exactly there saves the state, and later requests resume from it.
        """
        if not _is_id(request.request_id):
            raise AllocatorError(_id_error(request.request_id, "find_cached_prefix"))
        if request.request_id in self._running:
            raise AllocatorError(
                f"request {request.request_id!r} is already running; look up prefixes only "
                "before its first allocate_slots"
            )
        empty = tuple(() for _ in self.specs)
        epochs = tuple(pool.epoch for pool in self.pools)
        max_tokens = len(request.token_ids) - 1
        if not self._cacheable or max_tokens < self.hash_block_size:
            return CachedPrefix(request_id=request.request_id, num_tokens=0, block_ids=empty,
                                epochs=epochs)
        fine = self._hasher.hashes(request, max_tokens)
        if self._single_full:
            # One full-attention group whose blocks are hash blocks: its longest cached run
            # is the hit (the coordinator's fixed point, reached in one question).
            tokens = self._block_tokens[0]
            hit_blocks = self._coordinator.hit_scans[0](fine, self._caches[0], max_tokens // tokens)
            hit, checkpoint_at = len(hit_blocks) * tokens, None
            block_ids: tuple[tuple[int, ...], ...] = (tuple(hit_blocks),)
        else:
            try:
                hit, found, checkpoint_at = self._coordinator.find(fine, max_tokens)
            except KVSpecError:
                raise
            except Exception as error:
                raise self._plugin_error(error) from None
            block_ids = tuple(
                tuple(found[gid]) if gid in found else () for gid in range(len(self.specs))
            )
        prefix = CachedPrefix(
            request_id=request.request_id, num_tokens=hit, block_ids=block_ids, epochs=epochs,
            checkpoint_at=checkpoint_at,
        )
        if hit:
            handed = self._handed_out
            if len(handed) >= _HANDED_OUT_KEPT:
                handed.clear()
            handed[request.request_id] = (prefix, request, prefix.num_tokens, prefix.block_ids,
                                          prefix.epochs)
        return prefix

    #: The method itself, also under this name: what an instance's compiled lookup
    #: (``native.find_prefix``, its ``find_cached_prefix`` when the kernels are built) calls
    #: for every request it does not answer itself.
    _find_cached_prefix = find_cached_prefix

    # ----------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        lookahead: int = 0,
        prefix: CachedPrefix | None = None,
    ) -> Allocated | NotNow:
        """Slots for ``num_new_tokens`` tokens after the computed ones (plus ``lookahead``
        speculative slots); they count as computed once this returns :class:`Allocated`.

        The first call for a request admits it; pass the :class:`CachedPrefix` found for
        it (``num_new_tokens`` then counts tokens after the hit). Returns :class:`NotNow`
        (falsy, nothing changed) when blocks are short, the request would exceed the
        admission cap or ``max_model_len``, or the prefix went stale.
        """
        rid = request.request_id
        if rid.__class__ is not str and rid.__class__ is not int:
            # Other ids could run code in a dict lookup (and NaN is not equal to itself).
            raise AllocatorError(_id_error(rid, "allocate_slots"))
        state = self._running.get(rid)
        if state is None:
            return self._admit(request, num_new_tokens, lookahead, prefix)
        computed = state.computed
        if (
            # Exact ints only (no bool, no float): ``__class__`` is cheaper than ``type()``.
            num_new_tokens.__class__ is int is lookahead.__class__
            and num_new_tokens >= 0
            and lookahead >= 0
            and prefix is None
            and (known := computed + num_new_tokens) + lookahead < state.end_limit
            and known < state.known_limit
            and computed < state.computed_limit
        ):
            state.computed = known
            return self._no_new_blocks
        if prefix is not None:
            raise AllocatorError(
                f"request {request.request_id!r} is already running; a prefix applies only "
                "to its first allocate_slots"
            )
        if (
            self._dense
            and num_new_tokens.__class__ is int is lookahead.__class__
            and num_new_tokens >= 0
            and lookahead >= 0
        ):
            return self._grow_dense(state, num_new_tokens, lookahead)
        return self._grow(state, num_new_tokens, lookahead)

    #: The method itself, also under this name: what an instance's compiled fast path
    #: (``native.SlotsFastPath``, its ``allocate_slots`` when the kernels are built) calls
    #: for every step it does not answer itself.
    _allocate_slots = allocate_slots

    def allocate_step(
        self, steps: Iterable[tuple[Request, int] | Request], lookahead: int = 0
    ) -> list[Allocated | NotNow]:
        """Slots for every request of one engine step: ``steps`` holds ``(request,
        num_new_tokens)`` pairs, e.g. each running request with the tokens scheduled for it;
        a bare :class:`Request` stands for ``(request, 1)`` (a decode step).

        Exactly ``[allocate_slots(request, n, lookahead) for request, n in steps]``, in that
        order (results, block tables, hits and pool state alike), in one call: the steps
        that need no block cost a few integer comparisons each. A request not running yet
        is admitted without a cached prefix (admit with :meth:`allocate_slots` to pass one).
        If a pair raises (a bad count, say), the error propagates as from the loop and the
        pairs before it stay allocated.
        """
        if lookahead.__class__ is not int or lookahead < 0:
            raise AllocatorError(f"allocate_step: lookahead={lookahead!r} must be an int >= 0")
        running = self._running
        no_new_blocks = self._no_new_blocks
        results: list[Allocated | NotNow] = []
        if native is not None:
            # The same loop compiled; every pair it does not finish goes to _step_pair.
            native.step(steps, running, lookahead, no_new_blocks, self.allocate_slots,
                        lambda pair, position: self._step_pair(pair, position, lookahead),
                        results)
            return results
        append = results.append
        for pair in steps:
            request, num_new_tokens, state = self._step_item(pair, len(results))
            if state is not None and num_new_tokens.__class__ is int and num_new_tokens >= 0:
                # allocate_slots' no-block fast path, inlined.
                computed = state.computed
                known = computed + num_new_tokens
                if (
                    known + lookahead < state.end_limit
                    and known < state.known_limit
                    and computed < state.computed_limit
                ):
                    state.computed = known
                    append(no_new_blocks)
                    continue
            append(self.allocate_slots(request, num_new_tokens, lookahead))
        return results

    def decode_step(
        self, request_ids: Sequence[str | int], token_ids: Sequence[int], lookahead: int = 0
    ) -> list[Allocated | NotNow]:
        """One decode step of running requests, given as an engine's sampler reports it:
        request ``request_ids[i]`` sampled ``token_ids[i]``.

        Exactly ``request.token_ids.append(token); allocate_slots(request, 1, lookahead)``
        for each, in order (results, block tables, hits and pool state alike), in one call:
        the engine's own loop over the step's requests is not needed. Refuses, with
        :class:`AllocatorError`, lists of different lengths (before anything is done) and
        an id that names no running request (the requests before it were stepped). When
        ``allocate_slots`` refuses a request's step (a sampled token that cannot be hashed),
        that token is taken back off its list and the error raised: the requests before it
        were stepped, it and those after it are as they were.
        """
        if lookahead.__class__ is not int or lookahead < 0:
            raise AllocatorError(f"decode_step: lookahead={lookahead!r} must be an int >= 0")
        # Copies: code the step runs (a token's __index__) cannot change what is stepped.
        ids = tuple(request_ids)
        tokens = tuple(token_ids)
        if len(ids) != len(tokens):
            raise AllocatorError(
                f"decode_step: {len(ids)} request ids but {len(tokens)} tokens; pass the "
                "token each request sampled, in the order of request_ids"
            )
        results: list[Allocated | NotNow] = []
        if native is not None:
            stopped = native.decode_step(ids, tokens, self._running, lookahead,
                                         self._no_new_blocks, self.allocate_slots, results)
        else:
            stopped = self._decode_loop(ids, tokens, lookahead, results)
        if stopped >= 0:
            raise AllocatorError(
                f"decode_step: item {stopped}: {self._not_running_message(ids[stopped])}; the "
                f"{stopped} requests before it were stepped"
            )
        return results

    def _decode_loop(self, ids: Sequence[str | int], tokens: Sequence[int], lookahead: int,
                     results: list[Allocated | NotNow]) -> int:
        """:meth:`decode_step`'s loop (``native.decode_step`` in Python): the position of the
        first id that names no running request, or -1."""
        running = self._running
        append = results.append
        for position, rid in enumerate(ids):
            state = running.get(rid) if rid.__class__ is str or rid.__class__ is int else None
            if state is None:
                return position
            request = state.request
            token = tokens[position]
            token_list = request.token_ids
            token_list.append(token)
            try:
                append(self.allocate_slots(request, 1, lookahead))
            except BaseException:
                if token_list and token_list[-1] is token:  # refused: nothing changes
                    token_list.pop()
                raise
        return -1

    def _step_pair(self, pair: Any, position: int, lookahead: int) -> Allocated | NotNow:
        """``allocate_slots`` for item ``position`` of an :meth:`allocate_step`."""
        request, num_new_tokens, _ = self._step_item(pair, position)
        return self.allocate_slots(request, num_new_tokens, lookahead)

    def _step_item(self, pair: Any, position: int) -> tuple[Request, int, _Running | None]:
        """Item ``position`` of an :meth:`allocate_step` as ``(request, num_new_tokens,
        its running state or None)``; refuses what is not a Request or a pair."""
        try:
            if isinstance(pair, Request):
                request, num_new_tokens = pair, 1
            else:
                request, num_new_tokens = pair
            rid = request.request_id
            # An id of another type is refused by allocate_slots, before any lookup.
            return request, num_new_tokens, self._running.get(rid) if _is_id(rid) else None
        except (TypeError, ValueError, AttributeError):
            raise AllocatorError(
                f"allocate_step: item {position} is {pair!r}, not a Request or a "
                "(Request, int) pair; the items before it were allocated"
            ) from None

    def _check_counts(self, request: Request, num_new_tokens: int, lookahead: int) -> None:
        for name, value in (("num_new_tokens", num_new_tokens), ("lookahead", lookahead)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AllocatorError(
                    f"allocate_slots(request {request.request_id!r}): {name}={value!r} must "
                    "be an int >= 0: pass " + (
                        "the number of tokens to give slots to (1 per decode step; on "
                        "admission the prompt length minus the cached prefix)"
                        if name == "num_new_tokens" else "the speculative slots wanted, or 0"
                    )
                )

    def _over_length(self, request: Request, known: int) -> NotNow:
        return NotNow(
            reason=OVER_ADMISSION_CAP,
            message=(
                f"request {request.request_id!r} would hold {known} tokens, more than "
                f"max_model_len={self.max_model_len} the plan admits; finish or truncate it"
            ),
        )

    def _admit(
        self, request: Request, num_new_tokens: int, lookahead: int, prefix: CachedPrefix | None
    ) -> Allocated | NotNow:
        try:
            return self._admit_checked(request, num_new_tokens, lookahead, prefix)
        except KVSpecError:
            raise
        except Exception as error:
            raise self._plugin_error(error) from None

    def _plugin_error(self, error: Exception) -> Exception:
        """``error`` as a kvspec error naming the plugin when plugin rules raised it (they
        are asked before a step changes anything, so nothing changed), else ``error``."""
        found = plugin_rules_error(error, self.rules, self._rules_owners)
        if found is None:
            raise error
        return found

    def _preflight(self, request: Request, known: int, lengths: dict[int, int],
                   skips: dict[int, int], num_cached: Sequence[int],
                   cache_at: Sequence[int]) -> None:
        """Do, before a step changes anything, what could fail after it started: hash the
        tokens it caches (bad token ids), and ask the plugin rules what the step will ask
        them afterwards (new table ``lengths`` and ``skips`` per changed group)."""
        available = min(known, len(request.token_ids))
        if self._cacheable:
            self._hasher.hashes(request, available)
        for gid in self._guarded:
            rules = self.rules[gid]
            methods = self._guarded_methods[gid]
            if gid in lengths:
                if "next_allocation_end" in methods:
                    rules.next_allocation_end(lengths[gid])
                if "next_skip_position" in methods:
                    rules.next_skip_position(skips[gid])
            if ("cache_range" in methods and self._cacheable and available >= cache_at[gid]
                    and not (self._is_state_group[gid] and known > available)):
                rules.cache_range(num_cached[gid], available)

    def _admit_checked(
        self, request: Request, num_new_tokens: int, lookahead: int, prefix: CachedPrefix | None
    ) -> Allocated | NotNow:
        self._check_counts(request, num_new_tokens, lookahead)
        rid = request.request_id
        if prefix is None and rid in self._freed:
            raise AllocatorError(
                f"request {rid!r} was freed; allocate_slots for it now would admit it again "
                "from token 0, not continue it. To re-admit it (after preemption), call "
                "find_cached_prefix(request) and pass prefix=...; to start over, use a new "
                "request id"
            )
        group_count = len(self.specs)
        if prefix is None:
            computed = 0
            blocks = [[] for _ in range(group_count)]  # type: list[list[int]]
        else:
            stale = self._check_prefix(request, prefix)
            if stale is not None:
                return NotNow(
                    reason=STALE_PREFIX,
                    group=stale,
                    message=(
                        f"cached blocks of group {stale} found for request {rid!r} were "
                        "evicted since; call find_cached_prefix again"
                    ),
                )
            computed = prefix.num_tokens
            blocks = [list(ids) for ids in prefix.block_ids]
        known = computed + num_new_tokens
        if known > self.max_model_len:
            return self._over_length(request, known)
        total = min(known + lookahead, self.max_model_len)
        num_skipped = [0] * group_count
        pools = self.pools
        need = [0] * len(pools)
        plans: list[tuple[int, int, int]] = []
        for gid in self._holding:
            rules = self.rules[gid]
            table = blocks[gid]
            skip = min(rules.skipped_tokens(computed) // self._block_tokens[gid], len(table))
            for index in range(skip):
                table[index] = 0  # never touched, so nothing to release
            num_skipped[gid] = skip
            nulls, real = rules.blocks_needed(len(table), known, total, request.num_encoder_tokens)
            held = len(table) - table.count(0) + real
            if held > self.admission_caps[gid]:
                return self._over_cap(request, gid, held)
            pool_index = self._pool_of[gid]
            # Hit blocks with no reference (cached free ones) leave the free blocks on revival.
            need[pool_index] += real + pools[pool_index].num_unreferenced(table)
            plans.append((gid, nulls, real))
        shortfall = self._shortfall(need, [0] * len(pools))
        if shortfall is not None:
            return shortfall
        self._preflight(
            request, known,
            {gid: len(blocks[gid]) + nulls + real for gid, nulls, real in plans},
            dict(enumerate(num_skipped)),
            [len(ids) for ids in prefix.block_ids] if prefix is not None else [0] * group_count,
            [0] * group_count,
        )
        state = _Running(request, known, blocks)
        state.num_skipped = num_skipped
        new_ids: list[tuple[int, ...]] = [()] * group_count
        # Revive every group's hit blocks before any group takes new ones: groups sharing
        # a pool would otherwise evict (and take) each other's not-yet-revived hit blocks.
        # _check_prefix found each of them cached (in use, or a cached free block).
        for gid, _, _ in plans:
            self._group_pools[gid].touch(blocks[gid], known_cached=True)
        for gid, nulls, real in plans:
            table = blocks[gid]
            pool = self._group_pools[gid]
            if nulls:
                table.extend([0] * nulls)
            if real:
                taken = pool.take(real)
                table.extend(taken)
                state.num_real[gid] += real
                new_ids[gid] = tuple(taken)
            if prefix is not None:
                # Hit blocks are cached already; caching resumes after them.
                state.num_cached[gid] = len(prefix.block_ids[gid])
        self._running[rid] = state
        self._freed.pop(rid, None)
        self._handed_out.pop(rid, None)
        if self._cacheable:
            self._cache_new_blocks(state, known)
        self._update_limits(state)
        return Allocated(new_block_ids=tuple(new_ids))

    def _check_prefix(self, request: Request, prefix: CachedPrefix) -> int | None:
        """Check that ``prefix`` is a hit this allocator would hand out for ``request``:
        the first group one of whose blocks was evicted since (a stale prefix), or None.

        Whatever made it (find_cached_prefix, attrs.evolve, another allocator), a prefix
        is taken only if it reads as a hit of this request here: ``num_tokens`` an int in
        ``[0, len(token_ids))``, each holding group's table ``num_tokens // block`` exact
        ints (other groups': empty), real wherever the group needs its blocks to resume
        (from ``skipped_tokens(num_tokens)`` on), and each real block cached in its group
        under the request's own hash at its position. A block that is not refuses it with
        :class:`AllocatorError` when no pool evicted anything since it was found (it never
        was this request's), else it is stale (``None`` is not returned)."""
        rid = request.request_id
        if prefix.__class__ is not CachedPrefix:
            raise AllocatorError(
                f"allocate_slots(request {rid!r}): prefix= must be the CachedPrefix "
                f"find_cached_prefix returned for it, not a {type(prefix).__name__}"
            )
        found_for = prefix.request_id
        if found_for.__class__ is not rid.__class__ or found_for != rid:
            raise AllocatorError(
                f"prefix found for request {_describe(found_for)} was passed for request "
                f"{rid!r}; pass the CachedPrefix find_cached_prefix returned for it"
            )
        num_tokens = prefix.num_tokens
        block_ids = prefix.block_ids
        group_count = len(self.specs)
        if num_tokens.__class__ is not int or not (
                num_tokens == 0 or 0 < num_tokens < len(request.token_ids)):
            raise self._forged(request, f"num_tokens={_describe(num_tokens)} is not in "
                               f"[0, {len(request.token_ids)}) (the prompt, its last token "
                               "excluded)")
        if block_ids.__class__ is not tuple or len(block_ids) != group_count:
            raise self._forged(request, f"block_ids must be a tuple of {group_count} tables")
        holding = set(self._holding)
        for gid, ids in enumerate(block_ids):
            tokens = self._block_tokens[gid]
            expected = (num_tokens // tokens if gid in holding else 0)
            if ids.__class__ is not tuple or len(ids) != expected or (
                    gid in holding and num_tokens % tokens):
                raise self._forged(request, f"group {gid}'s table must hold {expected} block "
                                   f"ids for {num_tokens} tokens")
            if set(map(type, ids)) - _INT_ONLY:
                raise self._forged(request, f"group {gid}'s block ids must be ints")
        if not num_tokens:
            return None
        current = tuple(pool.epoch for pool in self.pools)
        entry = self._handed_out.get(rid)
        if (entry is not None and entry[0] is prefix and entry[1] is request
                and entry[2] is num_tokens and entry[3] is block_ids
                and entry[4] is prefix.epochs and current == prefix.epochs):
            # Handed out for this very request, unchanged, nothing evicted since: every
            # block is still cached under its hash (the structure was checked above).
            return None
        fine = self._hasher.hashes(request, num_tokens)
        stale = None
        evicted_since = prefix.epochs.__class__ is not tuple or current != prefix.epochs
        for gid in self._holding:
            ids = block_ids[gid]
            skip = self.rules[gid].skipped_tokens(num_tokens) // self._block_tokens[gid]
            if not all(ids[skip:]):
                raise self._forged(request, f"group {gid} needs its blocks from {skip} on to "
                                   "resume, the table has null entries there")
            stride = self._hash_stride[gid]
            cache = self._caches[gid]
            for index, block in enumerate(ids):
                if block and cache.get(fine[(index + 1) * stride - 1]) != block:
                    if not evicted_since:
                        raise self._forged(
                            request, f"block {block} at position {index} of group {gid} is "
                            "not cached for this request's tokens here")
                    if stale is None:
                        stale = gid
        return stale

    def _forged(self, request: Request, detail: str) -> AllocatorError:
        return AllocatorError(
            f"allocate_slots(request {request.request_id!r}): the prefix passed is not one "
            f"this allocator handed out for this request: {detail}; pass the CachedPrefix "
            "find_cached_prefix returned for it (unchanged)"
        )

    def _over_cap(self, request: Request, gid: int, held: int) -> NotNow:
        spec = self.specs[gid]
        return NotNow(
            reason=OVER_ADMISSION_CAP,
            group=gid,
            message=(
                f"request {request.request_id!r} would hold {held} blocks of group {gid} "
                f"({spec.kind}), over its admission cap of {self.admission_caps[gid]} "
                f"(spec.max_blocks_per_request for max_model_len={self.ctx.max_model_len}, "
                f"max_in_flight_tokens={self.ctx.max_in_flight_tokens}); schedule fewer tokens "
                "per step"
            ),
        )

    def _shortfall(self, need: list[int], freed: list[int]) -> NotNow | None:
        for index, pool in enumerate(self.pools):
            available = pool.num_free_blocks + freed[index]
            if need[index] > available:
                return NotNow(
                    reason=NO_FREE_BLOCKS,
                    blocks_needed=need[index],
                    blocks_free=available,
                    message=(
                        f"pool {index} has {available} free blocks, {need[index]} needed; "
                        "retry after a request finishes"
                    ),
                )
        return None

    def _grow(self, state: _Running, num_new_tokens: int, lookahead: int) -> Allocated | NotNow:
        try:
            return self._grow_checked(state, num_new_tokens, lookahead)
        except KVSpecError:
            raise
        except Exception as error:
            raise self._plugin_error(error) from None

    def _grow_checked(
        self, state: _Running, num_new_tokens: int, lookahead: int
    ) -> Allocated | NotNow:
        request = state.request
        if (
            type(num_new_tokens) is not int or type(lookahead) is not int
            or num_new_tokens < 0 or lookahead < 0
        ):
            self._check_counts(request, num_new_tokens, lookahead)
        computed = state.computed
        known = computed + num_new_tokens
        max_len = self.max_model_len
        if known > max_len:
            return self._over_length(request, known)
        total = known + lookahead
        if total > max_len:
            total = max_len
        if total < state.end_limit and computed < state.computed_limit:
            # Only a block became full: nothing to allocate or free, just cache it.
            self._preflight(request, known, {}, {}, state.num_cached, state.cache_at)
            state.computed = known
            known_limit = self.max_model_len + 1
            if self._cacheable:
                self._cache_new_blocks(state, known)
                for gid in self._holding:
                    if state.cache_at[gid] < known_limit:
                        known_limit = state.cache_at[gid]
            state.known_limit = known_limit
            return self._no_new_blocks
        pools = self.pools
        need = [0] * len(pools)
        freed = [0] * len(pools)
        plans: list[tuple[int, int, int, int]] = []
        blocks = state.blocks
        for gid in self._holding:
            rules = self.rules[gid]
            table = blocks[gid]
            done = state.num_skipped[gid]
            skip = rules.skipped_tokens(computed) // self._block_tokens[gid]
            if skip > len(table):
                skip = len(table)
            if skip < done:
                skip = done
            nulls, real = rules.blocks_needed(len(table), known, total, request.num_encoder_tokens)
            if not (nulls or real or skip > done):
                continue
            pool_index = self._pool_of[gid]
            if skip > done:
                refs = pools[pool_index].ref_counts
                dropped = [block for block in table[done:skip] if block]
                freed[pool_index] += [refs[block] for block in dropped].count(1)
                num_dropped = len(dropped)
            else:
                num_dropped = 0
            if real:
                held = state.num_real[gid] - num_dropped + real
                if held > self.admission_caps[gid]:
                    return self._over_cap(request, gid, held)
            need[pool_index] += real
            plans.append((gid, skip, nulls, real))
        shortfall = self._shortfall(need, freed)
        if shortfall is not None:
            return shortfall
        if self._guarded:
            lengths = {gid: len(blocks[gid]) + nulls + real for gid, _, nulls, real in plans}
            skips = {gid: skip for gid, skip, _, _ in plans}
        else:
            # Only plugin rules are asked in advance (core rules cannot raise).
            lengths = skips = {}
        self._preflight(request, known, lengths, skips, state.num_cached, state.cache_at)
        new_ids: list[tuple[int, ...]] = [()] * len(blocks)
        for gid, skip, _, _ in plans:
            done = state.num_skipped[gid]
            if skip > done:
                table = blocks[gid]
                # Later blocks first: they are evicted first, the shared prefix survives.
                dropped = [block for block in reversed(table[done:skip]) if block]
                table[done:skip] = [0] * (skip - done)
                state.num_skipped[gid] = skip
                state.num_real[gid] -= len(dropped)
                self._group_pools[gid]._release_unchecked(dropped)
        for gid, _, nulls, real in plans:
            table = blocks[gid]
            if nulls:
                table.extend([0] * nulls)
            if real:
                taken = self._group_pools[gid].take(real)
                table.extend(taken)
                state.num_real[gid] += real
                new_ids[gid] = tuple(taken)
        state.computed = known
        if self._cacheable:
            self._cache_new_blocks(state, known)
        self._update_limits(state)
        if not plans:
            return self._no_new_blocks
        return Allocated(new_block_ids=tuple(new_ids))

    def _grow_dense(
        self, state: _Running, num_new_tokens: int, lookahead: int
    ) -> Allocated | NotNow:
        """:meth:`_grow_checked` for allocators whose groups all follow the core's
        full-attention rules (see ``_dense``): nothing is ever skipped, a group needs
        ``cdiv(total, block_tokens)`` blocks and caches every full one. Same results and
        state as the general path, which the tests compare on random traces."""
        request = state.request
        max_len = self.max_model_len
        known = state.computed + num_new_tokens
        if known > max_len:
            return self._over_length(request, known)
        total = known + lookahead
        if total > max_len:
            total = max_len
        blocks = state.blocks
        block_tokens = self._block_tokens
        takes: list[tuple[int, int]] = []
        for gid in self._holding:
            real = -(-total // block_tokens[gid]) - len(blocks[gid])
            if real > 0:
                held = state.num_real[gid] + real
                if held > self.admission_caps[gid]:
                    return self._over_cap(request, gid, held)
                takes.append((gid, real))
        if takes:
            need = [0] * len(self.pools)
            for gid, real in takes:
                need[self._pool_of[gid]] += real
            shortfall = self._shortfall(need, [0] * len(self.pools))
            if shortfall is not None:
                return shortfall
        cacheable = self._cacheable
        available = len(request.token_ids)
        cached_upto = known if known < available else available
        if cacheable and (cached_upto >= state.known_limit or self._hash_finer):
            # Hash before anything changes: bad token ids refuse the step here (as the
            # general path's preflight, which hashes every completed hash block).
            fine = self._hasher.hashes(request, cached_upto)
        new_ids: list[tuple[int, ...]] = [()] * len(blocks)
        for gid, real in takes:
            taken = self._group_pools[gid].take(real)
            blocks[gid].extend(taken)
            state.num_real[gid] += real
            new_ids[gid] = tuple(taken)
        state.computed = known
        end_limit = known_limit = max_len + 1
        num_cached = state.num_cached
        cache_at = state.cache_at
        for gid in self._holding:
            tokens = block_tokens[gid]
            table = blocks[gid]
            end = len(table) * tokens + 1
            if end < end_limit:
                end_limit = end
            if cacheable:
                if cached_upto >= cache_at[gid]:
                    start = num_cached[gid]
                    stop = cached_upto // tokens
                    stride = self._hash_stride[gid]
                    self._group_pools[gid].cache_blocks(
                        gid, fine[(start + 1) * stride - 1 : stop * stride : stride],
                        table[start:stop],
                    )
                    num_cached[gid] = stop
                    cache_at[gid] = (stop + 1) * tokens
                if cache_at[gid] < known_limit:
                    known_limit = cache_at[gid]
        state.end_limit = end_limit
        state.known_limit = known_limit
        state.computed_limit = NEVER
        if not takes:
            return self._no_new_blocks
        return Allocated(new_block_ids=tuple(new_ids))

    def _cache_new_blocks(self, state: _Running, known: int) -> None:
        request = state.request
        available = len(request.token_ids)
        upto = known if known < available else available
        num_cached = state.num_cached
        cache_at = state.cache_at
        for gid in self._holding:
            if upto < cache_at[gid]:
                continue
            tokens = self._block_tokens[gid]
            if self._is_state_group[gid] and known > available:
                # The step ends past the tokens the engine appended (drafts): the state
                # it saves is not the state of a known prefix, so nothing is cached.
                start = stop = known // tokens
            else:
                start, stop = self.rules[gid].cache_range(num_cached[gid], upto)
            if stop > start:
                stride = self._hash_stride[gid]
                # The step's preflight hashed every full block it knows.
                fine = request.block_hashes
                if len(fine) < stop * stride:
                    fine = self._hasher.hashes(request, stop * tokens)
                digests = fine[(start + 1) * stride - 1 : stop * stride : stride]
                table = state.blocks[gid]
                pool = self._group_pools[gid]
                pool.cache_blocks(gid, digests, table[start:stop])
                if self._events is not None:
                    self._record_stored(self._events, gid, request, fine, table, start, stop)
            if stop > num_cached[gid]:
                num_cached[gid] = stop
            cache_at[gid] = (num_cached[gid] + 1) * tokens

    def _record_stored(self, events: list[KVCacheEvent], gid: int, request: Request,
                       fine: Sequence[bytes], table: list[int], start: int, stop: int) -> None:
        """One :class:`BlockStored` per run of real blocks in ``table[start:stop]``: a null
        entry (a block the window skipped before its tokens were known) holds nothing."""
        tokens = self._block_tokens[gid]
        stride = self._hash_stride[gid]
        index = start
        while index < stop:
            if not table[index]:
                index += 1
                continue
            first = index
            while index < stop and table[index]:
                index += 1
            events.append(
                BlockStored(
                    group=gid,
                    block_hashes=tuple(fine[(first + 1) * stride - 1 : index * stride : stride]),
                    parent_block_hash=fine[first * stride - 1] if first else None,
                    block_size=tokens,
                    token_ids=tuple(request.token_ids[first * tokens : index * tokens]),
                )
            )

    def _update_limits(self, state: _Running) -> None:
        end_limit = known_limit = self.max_model_len + 1
        computed_limit = NEVER
        cacheable = self._cacheable
        rules = self.rules
        blocks = state.blocks
        num_skipped = state.num_skipped
        cache_at = state.cache_at
        for gid in self._holding:
            group = rules[gid]
            end = group.next_allocation_end(len(blocks[gid]))
            if end < end_limit:
                end_limit = end
            skip_at = group.next_skip_position(num_skipped[gid])
            if skip_at < computed_limit:
                computed_limit = skip_at
            if cacheable and cache_at[gid] < known_limit:
                known_limit = cache_at[gid]
        state.end_limit = end_limit
        state.known_limit = known_limit
        state.computed_limit = computed_limit

    # ----------------------------------------------------------------- freeing
    def free(self, request_id: str | int) -> None:
        """Release every block of a request; blocks holding cached prefixes stay findable
        until evicted (its last blocks are evicted first). Refuses unknown ids and double
        frees with :class:`AllocatorError`, changing nothing."""
        state = self._state(request_id)
        # A running request's tables hold each block once, with a reference of its own
        # (check_invariants), so the pools' release checks cannot fire here. Each table is
        # released last block first, groups in order: the order one list per pool gives.
        group_pools = self._group_pools
        for gid, table in enumerate(state.blocks):
            group_pools[gid]._release_unchecked(table, reverse=True)
        del self._running[request_id]
        self._freed[request_id] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)

    def discard_uncomputed(self, request_id: str | int, num_valid_tokens: int) -> None:
        """Free a request whose computation stopped early (an engine's forward raised, or was
        interrupted), leaving no false hit behind.

        ``allocate_slots`` caches a block as soon as its tokens are known, before the engine
        writes its K/V (or saves its state). Here every block of the request that covers a
        position ``>= num_valid_tokens`` (the tokens whose cache content the engine did
        write) first leaves the prefix cache, so no later lookup can hit it; then the
        request is freed as by :meth:`free` (the blocks before stay cached). Works the same
        with the compiled kernels and in pure Python (it changes the pools' Python-side
        maps, which both read). A running request that already reused such a block keeps
        it, uncached. Refuses unknown ids, double frees and a count that is not an int in
        ``[0, num_computed_tokens]`` with :class:`AllocatorError`, changing nothing.
        """
        from kvspec_core.runtime.events import BlockRemoved

        state = self._state(request_id)
        if num_valid_tokens.__class__ is not int or not 0 <= num_valid_tokens <= state.computed:
            raise AllocatorError(
                f"discard_uncomputed(request {request_id!r}): num_valid_tokens="
                f"{num_valid_tokens!r} must be an int in [0, {state.computed}]: the tokens "
                "whose K/V or state the engine wrote before it stopped"
            )
        for gid in self._holding:
            pool = self._group_pools[gid]
            cache = self._caches[gid]
            block_hash = pool._block_hash
            removed: list[bytes] = []
            # Block i is cached under the hash of tokens [0, (i + 1) * block): it claims
            # content past num_valid_tokens from index num_valid_tokens // block on.
            for block in state.blocks[gid][num_valid_tokens // self._block_tokens[gid]:]:
                digest = block_hash[block] if block else None
                if digest is not None:
                    cache.pop(digest, None)
                    block_hash[block] = None
                    pool._reused[block] = 0
                    removed.append(digest)
            if removed:
                # A prefix found before may name these blocks: admissions check it again.
                pool.epoch += 1
                if self._events is not None:
                    self._events.append(BlockRemoved(group=gid, block_hashes=tuple(removed)))
        self.free(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks, uncached)."""
        for pool in self.pools:
            pool.reset_prefix_cache(record_event=False)
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Cross-check pools and block tables; raises :class:`AllocatorError` (tests)."""
        for pool in self.pools:
            pool.check_invariants()
        expected = [dict() for _ in self.pools]  # type: list[dict[int, int]]
        owner = [dict() for _ in self.pools]  # type: list[dict[int, int]]
        for state in self._running.values():
            for gid, table in enumerate(state.blocks):
                counts = expected[self._pool_of[gid]]
                owners = owner[self._pool_of[gid]]
                for block in table:
                    if block:
                        counts[block] = counts.get(block, 0) + 1
                        if owners.setdefault(block, gid) != gid:
                            raise AllocatorError(
                                f"pool {self._pool_of[gid]} block {block} is in the tables "
                                f"of groups {owners[block]} and {gid}"
                            )
        self._check_shared_prefixes()
        for index, pool in enumerate(self.pools):
            for block in range(1, pool.num_blocks):
                if pool.ref_counts[block] != expected[index].get(block, 0):
                    raise AllocatorError(
                        f"pool {index} block {block}: ref count {pool.ref_counts[block]} but "
                        f"{expected[index].get(block, 0)} block-table entries"
                    )

    def _check_shared_prefixes(self) -> None:
        """Each running request's block at position ``i`` of a group holds the prefix of the
        request's first ``(i + 1) * block`` tokens: a cached block is cached under the
        request's hash there, and a block two requests share sits at one position with one
        hash in both (where their hashes are known). Raises :class:`AllocatorError`."""
        seen: dict[tuple[int, int], tuple[int, bytes | None, str | int]] = {}
        for rid, state in self._running.items():
            if state.computed.__class__ is not int or not 0 <= state.computed <= self.max_model_len:
                raise AllocatorError(
                    f"request {rid!r}: {state.computed!r} computed tokens, not in "
                    f"[0, {self.max_model_len}]"
                )
            request = state.request
            fine = request.block_hashes if request._hash_owner is self._hasher else []
            for gid in self._holding:
                stride = self._hash_stride[gid]
                pool_index = self._pool_of[gid]
                block_hash = self._group_pools[gid]._block_hash
                for index, block in enumerate(state.blocks[gid]):
                    if not block:
                        continue
                    position = (index + 1) * stride - 1
                    mine = fine[position] if position < len(fine) else None
                    cached = block_hash[block]
                    if cached is not None and mine is not None and cached != mine:
                        raise AllocatorError(
                            f"request {rid!r} group {gid}: block {block} at position {index} "
                            "is cached under another prefix's hash than the request's"
                        )
                    other = seen.setdefault((pool_index, block), (index, mine, rid))
                    if other[2] != rid and (other[0] != index or (
                            mine is not None and other[1] is not None and other[1] != mine)):
                        raise AllocatorError(
                            f"pool {pool_index} block {block} is shared by requests "
                            f"{other[2]!r} (position {other[0]}) and {rid!r} (position "
                            f"{index}) whose prefixes (hashes) differ"
                        )
