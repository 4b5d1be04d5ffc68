"""Slots reserved in an offload tier for blocks fetched from a remote store shared by
replicas (``remote_tier.py``). Part of :class:`~kvspec_core.runtime.offloading.TierManager`
(see ``tier_state.py``).

**Where.** Fetched blocks go to the *first* tier with slots for the group's pool (host
memory): the next lookup loads them from there, the fastest tier, as it would a block the
device evicted a moment ago. Taking slots there may evict the tier's least recently used
entries, which are demoted to the tier below as any eviction is (the last tier drops).

**The order the engine keeps** (``RemoteTier.fetch`` does)::

    reservation = allocator.reserve_remote_blocks(group, hashes)
    run(reservation.demotions), complete them      # 1. they read the slots ...
    write the fetched pages into reservation.transfer.destination_blocks   # 2. ... these
    allocator.complete_transfers([reservation.transfer.transfer_id], ok=...)  # 3.

A demotion reads a slot the reservation hands out: it must have run (confirmed or failed)
before the fetched pages overwrite that slot, or the tier below would cache the fetched
bytes under the evicted block's hash. So every demotion is handed out with the reservation
(already taken: ``take_transfers()`` never returns them), and a reservation is refused
(None) while any copy out of that tier is still pending, taken or not: its source slot was
evicted, so it is free, and a reservation could hand it out before that copy ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.tier_state import PendingTransfer, TierState
from kvspec_core.runtime.tiers import REMOTE_TIER, STORE, Transfer


@attrs.frozen
class RemoteReservation:
    """Tier slots reserved for fetched blocks (``KVCacheAllocator.reserve_remote_blocks``).

    Attributes:
        transfer: the pending write of the fetched blocks (``source_tier``
            :data:`~kvspec_core.runtime.tiers.REMOTE_TIER`; ``source_blocks`` are positions
            in the hashes given, ``destination_blocks`` the reserved slots of
            ``destination_tier``). Complete it once the pages are written (``ok=False`` if
            the write failed: the slots are freed uncached).
        demotions: the copies of the tier entries the reservation evicted into the tiers
            below, in the order to run them; all must be run and completed (as any
            transfer, ``ok`` or not) before the pages are written. Empty when the tier had
            free slots or is the last one.
    """

    transfer: Transfer
    demotions: tuple[Transfer, ...] = ()


class TierRemote(TierState):
    """Reserving tier slots for remote blocks."""

    def reserve_remote(
        self, gid: int, hashes: Sequence[bytes], local: Mapping[int, Sequence[bytes]]
    ) -> RemoteReservation | None:
        """Reserve slots for blocks of group ``gid`` fetched from a remote store under
        ``hashes`` (a chain, in order) in the first tier with slots for the group's pool
        (see the module docstring for the order the caller keeps). The run stops before
        the first hash the device or any tier holds or has in flight, and at the tier's
        free (or evictable) slots. The tiers' entries for ``local`` (per group, hashes the
        request's hit needs: its local hit, blocks fetched for it already) are not evicted
        for it: the fetched blocks must continue that hit. None when nothing is reserved:
        no tier holds the pool, no hash is new, or a copy out of that tier is pending."""
        pool = self.pool_of_group[gid]
        index = next(
            (number for number, row in enumerate(self.tier_pools) if row[pool] is not None),
            None,
        )
        if index is None:
            return None
        tier = index + 1
        if any(
            pending.kind == STORE and pending.source_tier == tier
            for pending in self._pending.values()
        ):
            return None
        slots = self.tier_pools[index][pool]
        assert slots is not None
        # The local hit's entries, in every tier (a demotion may evict from the tiers
        # below), held while the slots are taken, so that no eviction takes them.
        held: list[tuple[BlockPool, list[int]]] = []
        for row in self.tier_pools:
            tier_slots = row[pool]
            if tier_slots is not None:
                found = [
                    slot
                    for group, group_hashes in local.items()
                    if (cache := tier_slots.caches.get(group)) is not None
                    for slot in map(cache.get, group_hashes)
                ]
                kept_slots = [slot for slot in dict.fromkeys(found) if slot is not None]
                tier_slots.touch(kept_slots, known_cached=True)
                held.append((tier_slots, kept_slots))
        try:
            view = self.views[gid]
            kept: list[bytes] = []
            for digest in hashes[: slots.num_free_blocks]:
                if digest in view or any(digest in storing[gid] for storing in self._storing):
                    break
                kept.append(digest)
            if not kept:
                return None
            # The evictions' demotions are recorded into a queue of their own (never
            # merged with a copy the step's take_transfers() will hand out), handed out here.
            step_queue, self._queue = self._queue, []
            try:
                taken = slots.take(len(kept))
                demotions = self._queue
            finally:
                self._queue = step_queue
        finally:
            for tier_slots, kept_slots in held:
                tier_slots._release_unchecked(kept_slots)
        for demotion in demotions:
            demotion.taken = True
        pending = PendingTransfer(
            self._next_id, STORE, gid, pool, REMOTE_TIER, tier, self.generation
        )
        self._next_id += 1
        pending.source.extend(range(len(kept)))  # positions in the fetched run
        pending.destination.extend(taken)
        pending.hashes.extend(kept)
        pending.taken = True
        self._pending[pending.transfer_id] = pending
        self._storing[index][gid].update(dict.fromkeys(kept, pending.transfer_id))
        return RemoteReservation(
            pending.record(), tuple(demotion.record() for demotion in demotions)
        )

    def holds_stored(self, transfer: Transfer) -> list[bool]:
        """Per block of a completed store ``transfer``, whether its destination tier caches
        the block's hash in that very slot now. A completed copy is not always cached (a
        write-through copy whose block ``discard_uncomputed`` declared unwritten is dropped
        at completion), and a slot may have been evicted and reused since: only a held
        block's slot holds that hash's pages. Read through the tier slots' cache mappings,
        as ``reserve_remote`` and the lookup do."""
        index = transfer.destination_tier - 1
        missing = [False] * len(transfer.destination_blocks)
        if not 0 <= index < len(self.tier_pools) or transfer.pool >= len(self.tier_pools[index]):
            return missing
        slots = self.tier_pools[index][transfer.pool]
        cache = None if slots is None else slots.caches.get(transfer.group)
        if cache is None:
            return missing
        return [
            cache.get(digest) == slot
            for digest, slot in zip(transfer.block_hashes, transfer.destination_blocks, strict=True)
        ]
