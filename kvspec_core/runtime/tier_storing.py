"""Recording copies into the offload tiers: the device's evictions (write-back) and a tier's
evictions down to the next tier.
Part of :class:`~kvspec_core.runtime.offloading.TierManager` (see ``tier_state.py``)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, repeat
from typing import Any

from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.tier_state import PendingTransfer, TierState
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
            mask = [group == gid for group in groups]
            if any(mask):
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
        self._store_each(index, pool, groups, hashes, source_tier, sources)

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
        block: the reference the batched forms give the same copies as."""
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
        pending = self._append(STORE, gid, pool, source_tier, index + 1)
        pending.source.extend(sources)
        pending.destination.extend(taken)
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


#: What ``split_held`` reads for a hash its cache does not hold.
_ABSENT: Any = object()


def split_held(
    cache: dict[bytes, int], in_flight: dict[bytes, int], hashes: list[bytes], sources: list[int]
) -> tuple[list[int], list[bytes], list[int]]:
    """One group's victims (``hashes``, copied from ``sources``) sorted for a tier store:
    the slots ``cache`` (the tier's ``hash -> slot``) holds some of them in, in order
    (repeats included; those become its most recently used entries instead of a copy),
    then the hashes to copy with their sources: those it does not hold, less those in flight
    to it (``in_flight``) and any repeat of an earlier one (a hash evicted twice since the
    last take, cached again in between: stored once, its first eviction).
    ``native.split_held`` in Python (the compiled one makes the lookups of a batch of
    hundreds of victims in one C loop)."""
    containers = ((cache, dict), (in_flight, dict), (hashes, list), (sources, list))
    if any(type(value) is not kind for value, kind in containers):
        raise TypeError("split_held: cache and in_flight must be dicts, hashes and sources lists")
    if len(hashes) != len(sources):
        raise ValueError("split_held: hashes and sources differ in length")
    # A sentinel, not None: a slot the cache maps to None is held, as the kernel counts it.
    found: list[Any] = list(map(cache.get, hashes, repeat(_ABSENT)))
    held: list[int] = []
    if found.count(_ABSENT) != len(found):
        absent = [slot is _ABSENT for slot in found]
        hashes = list(compress(hashes, absent))
        sources = list(compress(sources, absent))
        held = [slot for slot in found if slot is not _ABSENT]
    if (in_flight and not in_flight.keys().isdisjoint(hashes)) or len(set(hashes)) != len(hashes):
        seen: set[bytes] = set()
        kept_hashes: list[bytes] = []
        kept_sources: list[int] = []
        for digest, source in zip(hashes, sources, strict=True):
            if digest not in in_flight and digest not in seen:
                seen.add(digest)
                kept_hashes.append(digest)
                kept_sources.append(source)
        hashes, sources = kept_hashes, kept_sources
    return held, hashes, sources


def store_victims(
    pool: BlockPool,
    in_flight: dict[bytes, int],
    hashes: list[bytes],
    sources: list[int],
    out_sources: list[int],
    out_destinations: list[int],
    out_hashes: list[bytes],
    transfer_id: int,
) -> int:
    """Store one group's victims (``hashes``, copied from ``sources``) into ``pool``, an
    offload tier's pool of that one group, as one transfer: the hashes its cache holds
    become its most recently used entries (each once, in order of first sight), those in
    flight to it (``in_flight``: hash -> transfer id) and repeats are skipped, and the rest,
    the newest as many as it has free slots for, get slots (``pool.take``: free ones, then
    its oldest entries), appended to ``out_sources`` / ``out_destinations`` / ``out_hashes``
    (the transfer's lists), their hashes in flight to ``transfer_id``. Returns how many.
    Refuses, changing nothing, other containers than dicts and lists, hashes that are not
    bytes, sources that are not ints, lists of different lengths, a pool of several groups
    or one recording events, and a cache naming no slot of the pool.
    ``native.store_victims`` in Python (the compiled one does it in one C call)."""
    containers = (hashes, sources, out_sources, out_destinations, out_hashes)
    if (
        type(in_flight) is not dict
        or any(type(value) is not list for value in containers)
        or type(transfer_id) is not int
    ):
        raise TypeError(
            "store_victims: in_flight must be a dict, hashes, sources and the three outputs "
            "lists, transfer_id an int"
        )
    if len(hashes) != len(sources):
        raise ValueError("store_victims: hashes and sources differ in length")
    if any(type(digest) is not bytes for digest in hashes) or any(
        type(source) is not int for source in sources
    ):
        raise TypeError("store_victims: hashes must be bytes and sources ints")
    refs = pool.ref_counts
    if type(refs) is not list:
        raise TypeError("store_victims: the pool's ref_counts must be a list")
    size = len(refs)
    if pool._events is not None:
        raise ValueError("store_victims: the pool records events (a tier pool records none)")
    caches = pool.caches
    if type(caches) is not dict or len(caches) != 1 or type(_only(caches)) is not dict:
        raise TypeError("store_victims: the pool must serve one group (its caches: one dict)")
    # The kernel works on a pool built with it (its eviction orders are BlockQueues) and
    # refuses another before changing anything: so does this, where the kernels are built.
    orders = (pool._evictable, pool._protected)
    if native is not None and any(type(order) is not native.BlockQueue for order in orders):
        raise TypeError(
            "store_victims: the pool's eviction orders must be its BlockQueues (a pool built "
            "with the compiled kernels)"
        )
    held, kept_hashes, kept_sources = split_held(_only(caches), in_flight, hashes, sources)
    if any(type(slot) is not int or not 1 <= slot < size for slot in held):
        raise ValueError(
            "store_victims: the tier's cache maps a hash to a value that is no slot of its pool"
        )
    refresh_held(pool, held)
    room = pool.num_free_blocks
    if len(kept_hashes) > room:
        kept_hashes = kept_hashes[len(kept_hashes) - room :]
        kept_sources = kept_sources[len(kept_sources) - room :]
    if not kept_hashes:
        return 0
    taken = pool.take(len(kept_hashes))
    if type(taken) is not list:
        raise TypeError("BlockPool.take must return a list")
    if len(taken) != len(kept_hashes):
        raise RuntimeError("store_victims: the pool handed out a wrong count")
    out_sources.extend(kept_sources)
    out_destinations.extend(taken)
    out_hashes.extend(kept_hashes)
    in_flight.update(dict.fromkeys(kept_hashes, transfer_id))
    return len(kept_hashes)


def refresh_held(pool: BlockPool, held: list[int]) -> None:
    """The slots ``held`` (a tier's entries for victims it holds already; repeats allowed)
    become ``pool``'s most recently used entries, each once, in order of first sight (one in
    use keeps its count)."""
    if held:
        refresh = list(dict.fromkeys(held)) if len(held) > 1 else held
        pool.touch(refresh, known_cached=True)
        pool._release_unchecked(refresh)


def _only(caches: dict[int, dict[bytes, int]]) -> dict[bytes, int]:
    return next(iter(caches.values()))
