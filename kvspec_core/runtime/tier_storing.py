"""Recording copies into the offload tiers: the device's evictions (write-back) and a tier's
evictions down to the next tier.
Part of :class:`~kvspec_core.runtime.offloading.TierManager` (see ``tier_state.py``)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, repeat
from operator import eq

from kvspec_core.runtime.native import native
from kvspec_core.runtime.tier_state import PendingTransfer, TierState
from kvspec_core.runtime.tier_victims import refresh_held, split_held, store_victims
from kvspec_core.runtime.tiers import STORE


class TierStoring(TierState):
    """Recording the copies of evicted blocks into the tiers below."""

    # ----------------------------------------------------------------- recording copies
    def _demoter(
        self, index: int, pool: int
    ) -> Callable[[list[int], list[bytes], list[int]], None]:
        """The eviction hook of tier ``index`` (-1: the device) for ``pool``: store the
        victims in the next tier down that has slots for the pool."""

        def evicted(groups: list[int], hashes: list[bytes], blocks: list[int]) -> None:
            self._store(index + 1, pool, groups, hashes, index + 1, blocks)

        return evicted

    def _deferrer(self, pool: int) -> Callable[[list[int], list[bytes], list[int]], None]:
        """The device pool's eviction hook: note the victims (stored by :meth:`take`)."""
        append = self._victims[pool].append

        def evicted(groups: list[int], hashes: list[bytes], blocks: list[int]) -> None:
            append((groups, hashes, blocks))

        return evicted

    def _store(
        self,
        index: int,
        pool: int,
        groups: list[int],
        hashes: list[bytes],
        source_tier: int,
        sources: list[int],
    ) -> None:
        """Record the copies of ``sources`` (blocks of tier ``source_tier``, cached under
        ``hashes`` for ``groups``) into offload tier ``index`` (0-based) or the first one
        after it with slots for ``pool``. A hash the tier holds already becomes its most
        recently used entry instead; one in flight there is skipped; when fewer slots are
        free than copies (every other slot is in flight), the first victims are dropped (of a
        batch mixing groups, taken apart group by group: see :meth:`_store_each`)."""
        count = len(self.tiers)
        while index < count and self.tier_pools[index][pool] is None:
            index += 1
        if index >= count:
            return  # the last tier: dropped
        slots = self.tier_pools[index][pool]
        assert slots is not None
        if len(slots.caches) == 1:
            (only,) = slots.caches
            self._store_group(index, pool, only, hashes, source_tier, sources)
            return
        self._store_mixed(index, pool, groups, hashes, source_tier, sources)

    def _store_mixed(
        self,
        index: int,
        pool: int,
        groups: list[int],
        hashes: list[bytes],
        source_tier: int,
        sources: list[int],
    ) -> None:
        """:meth:`_store` into tier ``index`` (which has slots for ``pool``, a pool of
        several groups) of a batch that may mix the groups' victims (a hybrid's does, up to
        thousands a step): taken apart in whole-list passes, in order of each group's first
        victim, then stored as :meth:`_store_sorted` does."""
        if not len(groups) == len(hashes) == len(sources):
            raise ValueError("_store_mixed: groups, hashes and sources differ in length")
        if not groups:
            return
        # Most batches hold one group's victims (one C pass tells).
        if groups.count(groups[0]) == len(groups):
            self._store_sorted(index, pool, [(groups[0], hashes, sources)], source_tier)
            return
        batches = []
        for gid in dict.fromkeys(groups):
            mask = list(map(eq, groups, repeat(gid)))
            batches.append((gid, list(compress(hashes, mask)), list(compress(sources, mask))))
        self._store_sorted(index, pool, batches, source_tier)

    def _store_each(
        self,
        index: int,
        pool: int,
        groups: list[int],
        hashes: list[bytes],
        source_tier: int,
        sources: list[int],
    ) -> None:
        """:meth:`_store` into tier ``index`` (which has slots for ``pool``), block by
        block: the reference the batched forms give the same copies and transfers as. A
        batch of several groups' victims is taken apart first, group by group in order of
        each group's first victim (each group's in batch order)."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        caches = slots.caches
        storing = self._storing[index]
        rank = {gid: position for position, gid in enumerate(dict.fromkeys(groups))}
        victims = sorted(zip(groups, hashes, sources, strict=True), key=lambda v: rank[v[0]])
        refresh: list[int] = []
        kept: list[tuple[int, bytes, int]] = []
        # A hash evicted twice since the last take (cached again in between) is stored once.
        seen: set[tuple[int, bytes]] = set()
        for gid, digest, source in victims:
            held = caches[gid].get(digest)
            if held is not None:
                refresh.append(held)
            elif digest not in storing[gid] and (gid, digest) not in seen:
                seen.add((gid, digest))
                kept.append((gid, digest, source))
        refresh_held(slots, refresh)
        room = slots.num_free_blocks
        if len(kept) > room:
            kept = kept[len(kept) - room :]
        if not kept:
            return
        taken = slots.take(len(kept))  # may evict: those slots' stores are recorded first
        pending = None
        for (gid, digest, source), slot in zip(kept, taken, strict=True):
            if pending is None or pending.group != gid:
                pending = self._append(STORE, gid, pool, source_tier, index + 1)
            pending.source.append(source)
            pending.destination.append(slot)
            pending.hashes.append(digest)
            storing[gid][digest] = pending.transfer_id

    def _store_group(
        self,
        index: int,
        pool: int,
        gid: int,
        hashes: list[bytes],
        source_tier: int,
        sources: list[int],
    ) -> None:
        """:meth:`_store` into tier ``index`` (which has slots for ``pool``) of blocks of
        ``gid``, the only group of the pool: in one call of ``store_victims`` where no tier
        lies below (taking slots records nothing), else through :meth:`_store_sorted`."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        if slots._on_evict is None and hashes.__class__ is list and sources.__class__ is list:
            # No tier below this one: taking its slots records no transfer, so the copies'
            # transfer is chosen first and filled in the same call that sorts the victims,
            # refreshes the held ones and takes the slots.
            pending, new = self._store_target(gid, pool, source_tier, index + 1)
            kernels = native if slots._compiled else None
            store = store_victims if kernels is None else kernels.store_victims
            stored = store(
                slots,
                self._storing[index][gid],
                hashes,
                sources,
                pending.source,
                pending.destination,
                pending.hashes,
                pending.transfer_id,
            )
            if stored and new:
                self._enqueue(pending)
            return
        self._store_sorted(index, pool, [(gid, hashes, sources)], source_tier)

    def _store_sorted(
        self,
        index: int,
        pool: int,
        batches: list[tuple[int, list[bytes], list[int]]],
        source_tier: int,
    ) -> None:
        """:meth:`_store` into tier ``index`` (which has slots for ``pool``) of the victims
        of one group per batch (``(group, hashes, sources)``), as :meth:`_store_each` does
        block by block: each group's sorted in one C-level pass (``split_held``: held by
        the tier, in flight to it, repeated or to copy), every held entry refreshed before
        any slot is taken, one take for all, one transfer per group."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        storing = self._storing[index]
        held: list[int] = []
        kept: list[tuple[int, list[bytes], list[int]]] = []
        for gid, hashes, sources in batches:
            group_held, hashes, sources = _split_held(
                slots.caches[gid], storing[gid], hashes, sources, slots._compiled
            )
            held += group_held
            if hashes:
                kept.append((gid, hashes, sources))
        refresh_held(slots, held)
        # Fewer free slots than copies (every other slot is in flight): the first ones go.
        cut = sum(len(hashes) for _, hashes, _ in kept) - slots.num_free_blocks
        while cut > 0:
            gid, hashes, sources = kept[0]
            if len(hashes) <= cut:
                del kept[0]
            else:
                kept[0] = (gid, hashes[cut:], sources[cut:])
            cut -= len(hashes)
        if not kept:
            return
        wanted = sum(len(hashes) for _, hashes, _ in kept)
        taken = slots.take(wanted)  # may evict: those slots' stores are recorded first
        if len(taken) != wanted:
            raise ValueError(f"_store_sorted: the tier pool gave {len(taken)} of {wanted} slots")
        start = 0
        for gid, hashes, sources in kept:
            end = start + len(hashes)
            self._record_stores(index, pool, gid, source_tier, sources, taken[start:end], hashes)
            start = end

    def _record_stores(
        self,
        index: int,
        pool: int,
        gid: int,
        source_tier: int,
        sources: list[int],
        slots: list[int],
        hashes: list[bytes],
    ) -> None:
        """Record copies of ``gid``'s blocks ``sources`` (of tier ``source_tier``) into the
        taken ``slots`` of tier ``index`` under ``hashes``: extending the last store not
        handed out where it is the same copy, each hash in flight to that transfer."""
        pending = self._append(STORE, gid, pool, source_tier, index + 1)
        pending.source.extend(sources)
        pending.destination.extend(slots)
        pending.hashes.extend(hashes)
        self._storing[index][gid].update(dict.fromkeys(hashes, pending.transfer_id))

    def _append(
        self, kind: str, gid: int, pool: int, source_tier: int, destination_tier: int
    ) -> PendingTransfer:
        """The transfer to extend: the last one not handed out if it is the same kind of
        copy (so an eviction of many blocks is one batch), else a new one."""
        if kind == STORE:
            pending, new = self._store_target(gid, pool, source_tier, destination_tier)
        else:
            pending, new = (
                PendingTransfer(
                    self._next_id, kind, gid, pool, source_tier, destination_tier, self.generation
                ),
                True,
            )
        if new:
            self._enqueue(pending)
        return pending

    def _store_target(
        self, gid: int, pool: int, source_tier: int, destination_tier: int
    ) -> tuple[PendingTransfer, bool]:
        """The store to extend with copies of ``gid``'s blocks from ``source_tier`` to
        ``destination_tier``: the last transfer not handed out if it is one (False), else a
        new one, not yet recorded (True: :meth:`_enqueue` records it once it copies any)."""
        queue = self._queue
        if queue:
            last = queue[-1]
            if (
                last.kind == STORE
                and last.group == gid
                and last.source_tier == source_tier
                and last.destination_tier == destination_tier
            ):
                return last, False
        pending = PendingTransfer(
            self._next_id, STORE, gid, pool, source_tier, destination_tier, self.generation
        )
        return pending, True

    def _enqueue(self, pending: PendingTransfer) -> None:
        """Record ``pending`` (made with the next id) as in flight, last in the queue."""
        self._next_id += 1
        self._pending[pending.transfer_id] = pending
        self._queue.append(pending)


def _split_held(
    cache: dict[bytes, int],
    in_flight: dict[bytes, int],
    hashes: list[bytes],
    sources: list[int],
    compiled: bool,
) -> tuple[list[int], list[bytes], list[int]]:
    """``split_held``: the kernel for a pool built with the kernels and exact containers
    (a subclass's own lookups would not run in it), else its twin."""
    if (
        compiled
        and native is not None
        and cache.__class__ is dict
        and in_flight.__class__ is dict
        and hashes.__class__ is list
        and sources.__class__ is list
    ):
        return native.split_held(cache, in_flight, hashes, sources)
    return split_held(cache, in_flight, hashes, sources)
