"""Offload tiers below the device: what an engine configures (:class:`OffloadTier`), what a
lookup across tiers answers (:class:`TieredPrefix`) and what the engine must copy
(:class:`Transfer`). The bookkeeping is in ``offloading.py``; the copies in ``tier_copy.py``.

Tiers are numbered as the engine sees them: ``0`` is the device, ``1`` the first offload
tier (host memory, say), ``2`` the next (a local disk), and so on.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES, MAX_POOL_BLOCKS
from kvspec_core.runtime.results import CachedPrefix

#: ``Transfer.kind`` of a copy into the device (a tier hit being admitted).
LOAD = "load"
#: ``Transfer.kind`` of a copy out of the device or down a tier (an eviction's offload).
STORE = "store"
#: The tier number of the device.
DEVICE_TIER = 0
#: ``Transfer.source_tier`` of blocks fetched from a remote store shared by replicas
#: (``remote_tier.py``): never a tier of ``take_transfers()``, whose copies the engine runs.
REMOTE_TIER = -1
#: ``OffloadTier.write_policy``: a device block is copied into the tier when the device
#: evicts it from its prefix cache (the default).
WRITE_BACK = "write_back"
#: ``OffloadTier.write_policy``: a device block is copied into the tier as soon as it enters
#: the prefix cache (its content final), so that its eviction later copies nothing.
WRITE_THROUGH = "write_through"
#: The values ``OffloadTier.write_policy`` accepts.
WRITE_POLICIES = (WRITE_BACK, WRITE_THROUGH)
#: ``OffloadTier.keep``: every cached block the device evicts is stored below it.
KEEP_EVERYTHING = "everything"
#: ``OffloadTier.keep``: each group's family rules say which blocks are worth storing
#: below the device (``offload_range``: a sliding window keeps a freed request's last
#: window); groups whose rules say nothing store everything.
KEEP_FAMILY_RULES = "family_rules"
#: The values ``OffloadTier.keep`` accepts.
KEEP_POLICIES = (KEEP_EVERYTHING, KEEP_FAMILY_RULES)


@attrs.frozen
class OffloadTier:
    """One tier below the device: ``name`` (for reports), ``num_blocks`` (per pool of the
    allocator, one int for every pool or one per pool: the blocks of the tier's buffer for
    that pool, counted as the device's are, slot 0 included and never used, so slot ``s``
    is block ``s`` of the buffer; 0 gives the pool no slot in this tier), its own
    eviction order (``"lru"`` or ``"segmented"``, as the pools') and ``write_policy``,
    when the device's blocks are copied into it (for the pools whose first tier with slots
    it is; a tier below that receives what the tier above evicts):

    * :data:`WRITE_BACK` (``"write_back"``, the default): when the device evicts a cached
      block;
    * :data:`WRITE_THROUGH` (``"write_through"``): when a block enters the device's prefix
      cache; the copy is recorded by the first ``take_transfers()`` after the request
      that cached it was allocated again or freed (so the forward that writes it ran,
      however often the engine takes transfers), and a later eviction of a block the tier
      holds copies nothing.

    ``keep`` (for the same pools) says which of the device's blocks come here at all:
    :data:`KEEP_EVERYTHING` (``"everything"``, the default) or :data:`KEEP_FAMILY_RULES`
    (``"family_rules"``: a group whose family rules define ``offload_range`` stores only
    the blocks they name when the device evicts them, a sliding window a freed request's
    last window; see ``tier_keeping.py``).
    """

    name: str
    num_blocks: int | tuple[int, ...]
    eviction: str = DEFAULT_EVICTION
    write_policy: str = WRITE_BACK
    keep: str = KEEP_EVERYTHING

    def slots_per_pool(self, num_pools: int, index: int) -> tuple[int, ...]:
        """Slots of this tier per pool, checked; ``index`` is its place in the tier list."""
        where = f"offload_tiers[{index}] ({self.name!r})"
        if not isinstance(self.name, str) or not self.name or self.name == "device":
            raise AllocatorError(f"{where}: name must be a non-empty str other than 'device'")
        if self.eviction not in EVICTION_POLICIES:
            raise AllocatorError(
                f"{where}: eviction={self.eviction!r} is invalid: must be one of "
                f"{EVICTION_POLICIES}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise AllocatorError(
                f"{where}: write_policy={self.write_policy!r} is invalid: must be one of "
                f"{WRITE_POLICIES} (write_back: copied when the device evicts a block; "
                "write_through: copied when a block enters the device's prefix cache)"
            )
        if self.keep not in KEEP_POLICIES:
            raise AllocatorError(
                f"{where}: keep={self.keep!r} is invalid: must be one of {KEEP_POLICIES} "
                "(everything: every block the device evicts; family_rules: the blocks each "
                "group's family rules name, offload_range)"
            )
        sizes: Sequence[object] = (
            (self.num_blocks,) * num_pools
            if not isinstance(self.num_blocks, Sequence)
            else tuple(self.num_blocks)
        )
        if len(sizes) != num_pools:
            raise AllocatorError(
                f"{where}: num_blocks has {len(sizes)} entries for {num_pools} pools; give one "
                "int per pool of the allocator (or one int for all)"
            )
        for pool, size in enumerate(sizes):
            if (
                not isinstance(size, int)
                or isinstance(size, bool)
                or not (size == 0 or 2 <= size <= MAX_POOL_BLOCKS)
            ):
                raise AllocatorError(
                    f"{where}: num_blocks for pool {pool} is {size!r}; it must be 0 (no slot "
                    f"for that pool) or an int in [2, {MAX_POOL_BLOCKS}] (the tier buffer's "
                    "blocks, each one device block's pages; block 0 is never used)"
                )
        return tuple(sizes)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class TieredPrefix(CachedPrefix):
    """A :class:`CachedPrefix` part of which lies in offload tiers (what
    ``find_cached_prefix`` returns for an allocator with tiers when some hit block is not
    on the device). Admit it as any prefix; the loads then appear in
    ``take_transfers()``, and the request's block table is ``allocator.block_ids(rid)``.

    Attributes:
        block_ids: per group, the device blocks of the hit; ``0`` where a block will be
            loaded (see ``loads``) or the group needs none.
        loads: per group, ``(index, tier, slot)`` for each hit block held by tier ``tier``
            (``1`` = the first offload tier) in slot ``slot``, to be loaded to a device
            block at position ``index`` of the group's table on admission.
        tokens_by_tier: hit tokens per tier, device first. A token counts for the slowest
            tier any group loads its content from (positions a group does not need count
            for the tier of its next block).
        tier_epochs: per offload tier, per pool, the tier's eviction epoch (staleness).
    """

    loads: tuple[tuple[tuple[int, int, int], ...], ...]
    tokens_by_tier: tuple[int, ...]
    tier_epochs: tuple[tuple[int, ...], ...]


@attrs.frozen(kw_only=True)
class Transfer:
    """A batch of block copies the engine must run, in the order ``take_transfers()`` gave.

    Attributes:
        transfer_id: what to pass to ``complete_transfers``.
        kind: :data:`LOAD` (into the device, for ``request_id``'s admission) or
            :data:`STORE` (out of the device, or from one tier down to the next).
        group: the KV-cache group whose blocks move; ``pool`` the pool they belong to
            (block ids and tier slots are per pool).
        source_tier / destination_tier: ``0`` the device, ``1``.. the offload tiers.
        source_blocks / destination_blocks: block ids (device) or slots (tiers), paired.
        request_id: the request a load was admitted for (``None`` for stores).
        block_hashes: the hash each block is cached under, paired with the block lists
            (what a remote store keys a published block by).
    """

    transfer_id: int
    kind: str
    group: int
    pool: int
    source_tier: int
    destination_tier: int
    source_blocks: tuple[int, ...]
    destination_blocks: tuple[int, ...]
    request_id: str | int | None = None
    block_hashes: tuple[bytes, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.source_blocks)


def tiers_from_plan(
    plan: object,
    eviction: str = DEFAULT_EVICTION,
    write_policy: str = WRITE_BACK,
    keep: str = KEEP_EVERYTHING,
) -> tuple[OffloadTier, ...]:
    """The offload tiers of a planner plan (``plan.tiers``: host, then disk), for
    ``KVCacheAllocator.from_plan(plan, offload_tiers=tiers_from_plan(plan))``. Tiers are
    opt-in: an engine that uses them must run the transfers (see ``take_transfers``). A
    pool whose tier holds only its null block gets no slot there. Every tier evicts in
    ``eviction`` order; ``write_policy`` and ``keep`` are the first tier's (the one the
    device writes to; the tiers below receive what the tier above evicts)."""
    tiers = getattr(plan, "tiers", None) or ()
    return tuple(
        OffloadTier(
            str(tier.name),
            tuple(0 if count < 2 else int(count) for count in tier.blocks_per_pool),
            eviction,
            write_policy if index == 0 else WRITE_BACK,
            keep if index == 0 else KEEP_EVERYTHING,
        )
        for index, tier in enumerate(tiers)
    )
