"""Slots reserved in an offload tier for blocks fetched from a remote store shared by
replicas (``remote_tier.py``). Part of :class:`~kvspec_core.runtime.offloading.TierManager`
(see ``tier_state.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvspec_core.runtime.tier_state import PendingTransfer, TierState
from kvspec_core.runtime.tiers import REMOTE_TIER, STORE, Transfer


class TierRemote(TierState):
    """Reserving tier slots for remote blocks."""

    def reserve_remote(self, gid: int, hashes: Sequence[bytes]) -> Transfer | None:
        """Reserve slots for blocks of group ``gid`` fetched from a remote store under
        ``hashes`` (a chain, in order) in the last tier with slots for the group's pool:
        that tier's evictions drop, so taking its slots records no copy the engine would
        have to run before the fetched pages are written. The run stops before the first
        hash any tier holds or has in flight, and at the free slots. Returns the pending
        transfer (``source_tier`` :data:`REMOTE_TIER`, already taken: the caller writes
        the pages into ``destination_blocks`` and completes it, ``ok=False`` if the write
        failed), or None when nothing is reserved."""
        pool = self.pool_of_group[gid]
        index = max(
            (number for number, row in enumerate(self.tier_pools) if row[pool] is not None),
            default=None,
        )
        if index is None:
            return None
        slots = self.tier_pools[index][pool]
        assert slots is not None and slots._on_evict is None
        view = self.views[gid]
        kept: list[bytes] = []
        for digest in hashes[: slots.num_free_blocks]:
            if digest in view or any(digest in storing[gid] for storing in self._storing):
                break
            kept.append(digest)
        if not kept:
            return None
        pending = PendingTransfer(
            self._next_id, STORE, gid, pool, REMOTE_TIER, index + 1, self.generation
        )
        self._next_id += 1
        pending.source.extend(range(len(kept)))  # positions in the fetched run
        pending.destination.extend(slots.take(len(kept)))
        pending.hashes.extend(kept)
        pending.taken = True
        self._pending[pending.transfer_id] = pending
        self._storing[index][gid].update(dict.fromkeys(kept, pending.transfer_id))
        return pending.record()
