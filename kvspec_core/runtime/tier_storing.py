"""Recording copies into the offload tiers: the device's evictions (write-back) and a tier's
evictions down to the next tier.
Part of :class:`~kvspec_core.runtime.offloading.TierManager` (see ``tier_state.py``)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, repeat
from operator import contains, eq, is_, ne, not_
from typing import Any, cast

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
        free than copies (every other slot is in flight), the oldest victims are dropped."""
        count = len(self.tiers)
        while index < count and self.tier_pools[index][pool] is None:
            index += 1
        if index >= count:
            return  # the last tier: dropped
        slots = self.tier_pools[index][pool]
        assert slots is not None
        caches = slots.caches
        storing = self._storing[index]
        if len(caches) == 1:
            (only,) = caches
            self._store_group(index, pool, only, hashes, source_tier, sources)
            return
        per_group = {}
        for gid in caches:
            mask = list(map(eq, groups, repeat(gid)))
            if True in mask:
                per_group[gid] = (list(compress(hashes, mask)), list(compress(sources, mask)))
        if len(hashes) <= slots.num_free_blocks and all(
            not storing[gid]
            and len(set(group_hashes)) == len(group_hashes)
            and caches[gid].keys().isdisjoint(group_hashes)
            for gid, (group_hashes, _) in per_group.items()
        ):
            # None of them held or in flight and room for all (the steady state): in bulk.
            for gid, (group_hashes, group_sources) in per_group.items():
                self._store_all(index, pool, gid, group_hashes, source_tier, group_sources)
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
        """:meth:`_store_each` in whole-list passes (a hybrid's batch mixes its groups'
        victims, up to thousands a step): the same copies, refreshes, drops and transfers
        (one per run of a group's victims, in batch order)."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        storing = self._storing[index]
        if not len(groups) == len(hashes) == len(sources):
            raise ValueError("_store_mixed: groups, hashes and sources differ in length")
        caches = slots.caches
        # Per victim, the tier's slot for its hash (None: not held), without a Python
        # step per victim (a batch is up to thousands).
        held = list(map(dict.get, map(caches.__getitem__, groups), hashes))
        absent = list(map(is_, held, repeat(None)))
        kept_groups, kept_hashes, kept_sources = _kept((groups, hashes, sources), absent)
        if any(storing[gid] for gid in set(kept_groups)):
            # Those in flight to the tier are skipped.
            landing = list(
                map(not_, map(contains, map(storing.__getitem__, kept_groups), kept_hashes))
            )
            kept_groups, kept_hashes, kept_sources = _kept(
                (kept_groups, kept_hashes, kept_sources), landing
            )
        pairs = list(zip(kept_groups, kept_hashes, strict=True))
        if len(set(pairs)) != len(pairs):
            # A hash evicted twice since the last take (cached again in between): its
            # first victim is stored, once.
            firsts: dict[tuple[int, bytes], int] = {}
            first = [
                firsts.setdefault(pair, position) == position for position, pair in enumerate(pairs)
            ]
            kept_groups, kept_hashes, kept_sources = _kept(
                (kept_groups, kept_hashes, kept_sources), first
            )
        refresh_held(slots, cast(list[int], list(compress(held, map(not_, absent)))))
        room = slots.num_free_blocks
        if len(kept_hashes) > room:
            cut = len(kept_hashes) - room
            kept_groups, kept_hashes, kept_sources = (
                kept_groups[cut:],
                kept_hashes[cut:],
                kept_sources[cut:],
            )
        if not kept_hashes:
            return
        taken = slots.take(len(kept_hashes))  # may evict: those slots' stores are recorded first
        if len(taken) != len(kept_hashes):
            raise ValueError(
                f"_store_mixed: the tier pool gave {len(taken)} of {len(kept_hashes)} slots"
            )
        # One transfer per run of a group's victims, in batch order.
        count = len(kept_groups)
        starts = [0, *compress(range(1, count), map(ne, kept_groups[1:], kept_groups[:-1]))]
        for start, end in zip(starts, [*starts[1:], count], strict=True):
            self._record_stores(
                index,
                pool,
                kept_groups[start],
                source_tier,
                kept_sources[start:end],
                taken[start:end],
                kept_hashes[start:end],
            )

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
        block: the reference the batched forms give the same copies as (and
        :meth:`_store_mixed` the same transfers)."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        caches = slots.caches
        storing = self._storing[index]
        refresh: list[int] = []
        kept: list[tuple[int, bytes, int]] = []
        # A hash evicted twice since the last take (cached again in between) is stored once.
        seen: set[tuple[int, bytes]] = set()
        for gid, digest, source in zip(groups, hashes, sources, strict=True):
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
        ``gid``, the only group of the pool: the same copies, refreshes and drops as the
        per-block loop of several groups, found with a few passes over the lists (a batch
        of evictions is hundreds of blocks, and a hash a load brought back to the device
        is held by the tier already)."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        in_flight = self._storing[index][gid]
        if slots._on_evict is None and hashes.__class__ is list and sources.__class__ is list:
            # No tier below this one: taking its slots records no transfer, so the copies'
            # transfer is chosen first and filled in the same call that sorts the victims,
            # refreshes the held ones and takes the slots.
            pending, new = self._store_target(gid, pool, source_tier, index + 1)
            kernels = native if slots._compiled else None
            store = store_victims if kernels is None else kernels.store_victims
            stored = store(
                slots,
                in_flight,
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
        cache = slots.caches[gid]
        kernels = native if slots._compiled else None
        if (
            kernels is not None
            and cache.__class__ is dict
            and in_flight.__class__ is dict
            and hashes.__class__ is list
            and sources.__class__ is list
        ):
            held, hashes, sources = kernels.split_held(cache, in_flight, hashes, sources)
        else:
            held, hashes, sources = split_held(cache, in_flight, hashes, sources)
        refresh_held(slots, held)
        self._store_all(index, pool, gid, hashes, source_tier, sources)

    def _store_all(
        self,
        index: int,
        pool: int,
        gid: int,
        hashes: list[bytes],
        source_tier: int,
        sources: list[int],
    ) -> None:
        """:meth:`_store` of blocks of one group none of which tier ``index`` holds or has in
        flight: as many as there are free slots (the newest victims), in one batch."""
        slots = self.tier_pools[index][pool]
        assert slots is not None
        room = slots.num_free_blocks
        if len(hashes) > room:
            hashes = hashes[len(hashes) - room :]
            sources = sources[len(sources) - room :]
        if not hashes:
            return
        taken = slots.take(len(hashes))  # may evict: those slots' stores are recorded first
        self._record_stores(index, pool, gid, source_tier, sources, taken, hashes)

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


def _kept(columns: tuple[list[Any], ...], mask: list[bool]) -> tuple[list[Any], ...]:
    """Each of ``columns`` (lists of one length) with only the items ``mask`` keeps."""
    return tuple(list(compress(column, mask)) for column in columns)
