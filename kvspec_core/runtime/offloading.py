"""The bookkeeping of offload tiers (``TierManager``): which hashes each tier holds in which
slot, the copies the engine has not confirmed yet, and the lookups across tiers.

Each offload tier keeps one :class:`~kvspec_core.runtime.pool.BlockPool` per device pool
(its "blocks" are the tier's slots, with the same per-group ``hash -> slot`` caches and the
same eviction orders), so a tier evicts exactly as the device does. Hooks chain the tiers:

* a device block leaving the prefix cache (pool eviction) is stored in the first tier with
  slots for its pool (write-back on eviction), unless that tier holds its hash already;
* a tier's own eviction stores the slot's content in the next tier; the last tier drops it.

A copy is *pending* from the moment it is recorded until the engine confirms it
(``complete_transfers``): its destination holds a reference (never evicted, never handed
out) and is not cached (never a hit). A load also holds a reference on its source slots.
Confirmed, the destination enters its cache; failed, it returns to the free blocks
uncached. A store's source is not held: it was evicted and is handed out right away, which
is why the engine runs the transfers, in order, before the step's forward overwrites it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import compress

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.results import CachedPrefix
from kvspec_core.runtime.rules import FamilyRules, FullAttentionRules, HitScan
from kvspec_core.runtime.tiers import (
    DEVICE_TIER,
    LOAD,
    REMOTE_TIER,
    STORE,
    OffloadTier,
    TieredPrefix,
    Transfer,
)

#: TieredPrefixes handed out and not yet admitted that an admission trusts without the
#: per-load check; past this many, forgotten (their admissions check them).
HANDED_OUT_KEPT = 4096


class _Pending:
    """One transfer in flight (the mutable twin of the :class:`Transfer` handed out)."""

    __slots__ = (
        "destination",
        "destination_tier",
        "first_position",
        "generation",
        "group",
        "hashes",
        "kind",
        "pool",
        "request",
        "request_id",
        "source",
        "source_tier",
        "taken",
        "transfer_id",
    )

    def __init__(
        self,
        transfer_id: int,
        kind: str,
        group: int,
        pool: int,
        source_tier: int,
        destination_tier: int,
        generation: int,
    ) -> None:
        self.transfer_id = transfer_id
        self.kind = kind
        self.group = group
        self.pool = pool
        self.source_tier = source_tier
        self.destination_tier = destination_tier
        self.generation = generation
        self.source: list[int] = []
        self.destination: list[int] = []
        self.hashes: list[bytes] = []
        self.request_id: str | int | None = None
        # The running state a load was admitted into (a failed load discards it, if it
        # still runs: not a later request reusing the id).
        self.request: object = None
        # A load's first token position (the smallest its blocks start at).
        self.first_position = 0
        self.taken = False

    def record(self) -> Transfer:
        return Transfer(
            transfer_id=self.transfer_id,
            kind=self.kind,
            group=self.group,
            pool=self.pool,
            source_tier=self.source_tier,
            destination_tier=self.destination_tier,
            source_blocks=tuple(self.source),
            destination_blocks=tuple(self.destination),
            request_id=self.request_id,
            block_hashes=tuple(self.hashes),
        )


class TieredView(Mapping[bytes, int]):
    """One group's prefix cache seen across tiers, for the family rules' ``longest_hit``:
    a hash cached on the device maps to its block id; one held (confirmed) by offload tier
    ``t`` only, to the negative code ``-(slot * count + t)`` (``count`` tiers), which
    :meth:`TierManager.prefix` turns into a load. The rules decide hits over this merged
    view with their own logic, so a hit is one the group can resume from whichever tier
    holds each block."""

    __slots__ = ("count", "device", "tiers")

    def __init__(
        self, device: dict[bytes, int], tiers: Sequence[tuple[int, dict[bytes, int]]], count: int
    ) -> None:
        self.device = device
        self.tiers = tuple(tiers)
        self.count = count

    def get(self, digest: bytes, default: int | None = None) -> int | None:  # type: ignore[override]
        block = self.device.get(digest)
        if block is not None:
            return block
        for number, cache in self.tiers:
            slot = cache.get(digest)
            if slot is not None:
                return -(slot * self.count + number)
        return default

    def __getitem__(self, digest: bytes) -> int:
        found = self.get(digest)
        if found is None:
            raise KeyError(digest)
        return found

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, bytes) and self.get(digest) is not None

    def __iter__(self) -> Iterator[bytes]:
        seen = set(self.device)
        yield from self.device
        for _, cache in self.tiers:
            for digest in cache:
                if digest not in seen:
                    seen.add(digest)
                    yield digest

    def __len__(self) -> int:
        return sum(1 for _ in self)


class TierManager:
    """Offload tiers of one allocator (see the module docstring).

    Args:
        tiers: the tiers below the device, fastest first.
        device_pools: the allocator's pools (their ``on_evict`` hooks are set here).
        pool_of_group: pool index of each group.
        device_caches: per group, the device prefix cache (``hash -> block``).
        rules / device_scans: per group, its rules and its scan of the device cache.
    """

    def __init__(
        self,
        tiers: Sequence[OffloadTier],
        device_pools: Sequence[BlockPool],
        pool_of_group: Sequence[int],
        device_caches: Sequence[dict[bytes, int]],
        rules: Sequence[FamilyRules],
        device_scans: Sequence[HitScan],
    ) -> None:
        self.tiers = tuple(tiers)
        self.device_pools = list(device_pools)
        self.pool_of_group = list(pool_of_group)
        count = len(self.tiers)
        #: Per device pool, its evictions since the last :meth:`take`, as the pool's hook
        #: reports them (``(groups, hashes, blocks)``): stored in the tiers by :meth:`take`,
        #: once per engine step, before the step's loads (see :meth:`take`).
        self._victims: list[list[tuple[list[int], list[bytes], list[int]]]] = [
            [] for _ in device_pools
        ]
        #: Per offload tier (0-based), per pool: its slots' pool, or None (no slots there).
        self.tier_pools: list[list[BlockPool | None]] = []
        for index, tier in enumerate(self.tiers):
            row: list[BlockPool | None] = []
            for pool_index, size in enumerate(tier.slots_per_pool(len(device_pools), index)):
                if size == 0:
                    row.append(None)
                    continue
                slots = BlockPool(size, device_pools[pool_index].group_ids, eviction=tier.eviction)
                row.append(slots)
            self.tier_pools.append(row)
        for index, row in enumerate(self.tier_pools):
            for pool_index, tier_pool in enumerate(row):
                below = [later[pool_index] for later in self.tier_pools[index + 1 :]]
                if tier_pool is not None and any(later is not None for later in below):
                    # Only a tier with a tier below it for this pool demotes (the last
                    # drops: its evictions keep the compiled path).
                    tier_pool._on_evict = self._demoter(index, pool_index)
        for pool_index, pool in enumerate(self.device_pools):
            pool._on_evict = self._deferrer(pool_index)
        self.views = [
            TieredView(
                device_caches[gid],
                [
                    (index + 1, tier_slots.caches.setdefault(gid, {}))
                    for index, row in enumerate(self.tier_pools)
                    if (tier_slots := row[pool]) is not None
                ],
                count,
            )
            for gid, pool in enumerate(self.pool_of_group)
        ]
        #: Per group, how a lookup scans its view: a full-attention group scans its
        #: device cache (compiled where built) and goes on in the tiers after its run;
        #: other groups' rules decide over the whole view.
        self.scans: list[HitScan] = [
            _full_scan(device_scan)
            if getattr(type(group), "longest_hit", None) is FullAttentionRules.longest_hit
            else group.longest_hit
            for group, device_scan in zip(rules, device_scans, strict=True)
        ]
        #: Per offload tier, per group: hash -> id of the store in flight bringing it there.
        self._storing: list[dict[int, dict[bytes, int]]] = [
            {gid: {} for gid in range(len(self.pool_of_group))} for _ in self.tiers
        ]
        self._pending: dict[int, _Pending] = {}
        # Per request id, the TieredPrefix last handed out and what it was made of.
        self._handed: dict[str | int, tuple[object, ...]] = {}
        self._queue: list[_Pending] = []
        self._next_id = 1
        # Bumped by reset_prefix_cache: transfers of an older generation cache nothing.
        self.generation = 0
        #: Blocks confirmed moved, per (source tier, destination tier).
        self.blocks_moved: dict[tuple[int, int], int] = {}

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
        refresh: list[int] = []
        kept: list[tuple[int, bytes, int]] = []
        if len(caches) == 1:
            (only,) = caches
            per_group = {only: (hashes, sources)}
        else:
            per_group = {}
            for gid in caches:
                mask = [group == gid for group in groups]
                if any(mask):
                    per_group[gid] = (list(compress(hashes, mask)), list(compress(sources, mask)))
        if len(hashes) <= slots.num_free_blocks and all(
            not storing[gid]
            and len(set(group_hashes)) == len(group_hashes)
            and list(map(caches[gid].get, group_hashes)).count(None) == len(group_hashes)
            for gid, (group_hashes, _) in per_group.items()
        ):
            # None of them held or in flight and room for all (the steady state): in bulk.
            for gid, (group_hashes, group_sources) in per_group.items():
                self._store_all(index, pool, gid, group_hashes, source_tier, group_sources)
            return
        # A hash evicted twice since the last take (cached again in between) is stored once.
        seen: set[tuple[int, bytes]] = set()
        for gid, digest, source in zip(groups, hashes, sources, strict=True):
            held = caches[gid].get(digest)
            if held is not None:
                refresh.append(held)
            elif digest not in storing[gid] and (gid, digest) not in seen:
                seen.add((gid, digest))
                kept.append((gid, digest, source))
        if refresh:
            refresh = list(dict.fromkeys(refresh))
            slots.touch(refresh, known_cached=True)
            slots._release_unchecked(refresh)
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
    ) -> _Pending:
        """The transfer to extend: the last one not handed out if it is the same kind of
        copy (so an eviction of many blocks is one batch), else a new one."""
        queue = self._queue
        if queue:
            last = queue[-1]
            if (
                kind == STORE
                and last.kind == STORE
                and last.group == gid
                and last.source_tier == source_tier
                and last.destination_tier == destination_tier
            ):
                return last
        pending = _Pending(
            self._next_id, kind, gid, pool, source_tier, destination_tier, self.generation
        )
        self._next_id += 1
        self._pending[pending.transfer_id] = pending
        queue.append(pending)
        return pending

    # ----------------------------------------------------------------- remote blocks
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
        pending = _Pending(self._next_id, STORE, gid, pool, REMOTE_TIER, index + 1, self.generation)
        self._next_id += 1
        pending.source.extend(range(len(kept)))  # positions in the fetched run
        pending.destination.extend(slots.take(len(kept)))
        pending.hashes.extend(kept)
        pending.taken = True
        self._pending[pending.transfer_id] = pending
        self._storing[index][gid].update(dict.fromkeys(kept, pending.transfer_id))
        return pending.record()

    # ----------------------------------------------------------------- lookups
    def prefix(
        self,
        request_id: str | int,
        hit: int,
        found: dict[int, list[int]],
        checkpoint_at: int | None,
        epochs: tuple[int, ...],
        group_count: int,
        block_tokens: Sequence[int],
        hash_block_size: int,
    ) -> CachedPrefix:
        """The prefix for the coordinator's answer over :attr:`views`: a plain
        :class:`CachedPrefix` when every hit block is on the device, else a
        :class:`TieredPrefix` naming the loads."""
        count = len(self.tiers)
        block_ids: list[tuple[int, ...]] = []
        loads: list[tuple[tuple[int, int, int], ...]] = []
        any_load = False
        for gid in range(group_count):
            ids = found.get(gid)
            if ids is None:
                block_ids.append(())
                loads.append(())
                continue
            group_loads = []
            table = list(ids)
            for index, block in enumerate(table) if table and min(table) < 0 else ():
                if block < 0:
                    code = -block
                    number = (code - 1) % count + 1
                    group_loads.append((index, number, (code - number) // count))
                    table[index] = 0
            block_ids.append(tuple(table))
            loads.append(tuple(group_loads))
            any_load = any_load or bool(group_loads)
        if not any_load:
            return CachedPrefix(
                request_id=request_id,
                num_tokens=hit,
                block_ids=tuple(block_ids),
                epochs=epochs,
                checkpoint_at=checkpoint_at,
            )
        return TieredPrefix(
            request_id=request_id,
            num_tokens=hit,
            block_ids=tuple(block_ids),
            epochs=epochs,
            checkpoint_at=checkpoint_at,
            loads=tuple(loads),
            tokens_by_tier=self._tokens_by_tier(hit, found, block_tokens, hash_block_size, count),
            tier_epochs=self.tier_epochs(),
        )

    @staticmethod
    def _tokens_by_tier(
        hit: int,
        found: dict[int, list[int]],
        block_tokens: Sequence[int],
        hash_block_size: int,
        count: int,
    ) -> tuple[int, ...]:
        """Hit tokens per tier (device first): each hash block counts for the slowest tier
        any group takes its content from; a position a group does not need (null) counts
        for the tier of the group's next block."""
        (ids,) = found.values() if len(found) == 1 else ([0],)
        if block_tokens[next(iter(found))] == hash_block_size and 0 not in ids:
            # One group whose blocks are hash blocks, all real (full attention).
            counts = [0] * (count + 1)
            counts[0] = len(ids) - sum(1 for block in ids if block < 0)
            for block in ids:
                if block < 0:
                    counts[(-block - 1) % count + 1] += 1
            return tuple(number * hash_block_size for number in counts)
        slowest = [0] * (hit // hash_block_size)
        for gid, ids in found.items():
            stride = block_tokens[gid] // hash_block_size
            tier = 0
            for index in range(len(ids) - 1, -1, -1):
                block = ids[index]
                if block:
                    tier = 0 if block > 0 else (-block - 1) % count + 1
                for fine in range(index * stride, min((index + 1) * stride, len(slowest))):
                    if tier > slowest[fine]:
                        slowest[fine] = tier
        totals = [0] * (count + 1)
        for tier in slowest:
            totals[tier] += hash_block_size
        return tuple(totals)

    def tier_epochs(self) -> tuple[tuple[int, ...], ...]:
        return tuple(
            tuple(-1 if slots is None else slots.epoch for slots in row) for row in self.tier_pools
        )

    def hand_out(self, request: object, prefix: TieredPrefix) -> None:
        """Remember ``prefix`` as found for ``request`` (the very objects): its admission
        then skips the per-load check while no tier evicted since (see check_loads)."""
        if len(self._handed) >= HANDED_OUT_KEPT:
            self._handed.clear()
        self._handed[prefix.request_id] = (
            prefix,
            request,
            prefix.loads,
            prefix.block_ids,
            prefix.tier_epochs,
        )

    def check_loads(
        self,
        request: object,
        prefix: TieredPrefix,
        fine: Sequence[bytes],
        holding: Sequence[int],
        hash_strides: Sequence[int],
    ) -> tuple[int | None, str | None]:
        """``(stale group, None)`` when a load's slot no longer holds its hash and a tier
        evicted since the lookup; ``(None, why)`` when a load is not one this allocator
        could have handed out (the caller refuses the prefix); ``(None, None)`` if fine."""
        entry = self._handed.pop(prefix.request_id, None)
        if (
            entry is not None
            and entry[0] is prefix
            and entry[1] is request
            and entry[2] is prefix.loads
            and entry[3] is prefix.block_ids
            and entry[4] is prefix.tier_epochs
            and prefix.tier_epochs == self.tier_epochs()
        ):
            # Handed out for this very request, unchanged, no tier evicted since: every
            # load's slot still holds its hash (a tier's cached entries change only with
            # its epoch).
            return None, None
        loads = prefix.loads
        if loads.__class__ is not tuple or len(loads) != len(prefix.block_ids):
            return None, f"loads must be a tuple of {len(prefix.block_ids)} tuples"
        moved = prefix.tier_epochs != self.tier_epochs()
        count = len(self.tiers)
        for gid, group_loads in enumerate(loads):
            ids = prefix.block_ids[gid]
            if group_loads.__class__ is not tuple:
                return None, f"group {gid}'s loads must be a tuple"
            seen: set[int] = set()
            for entry in group_loads:
                if (
                    entry.__class__ is not tuple
                    or len(entry) != 3
                    or any(value.__class__ is not int for value in entry)
                ):
                    return None, f"group {gid}'s loads must be (index, tier, slot) int triples"
                index, tier, slot = entry
                if gid not in holding or not 0 <= index < len(ids) or ids[index] or index in seen:
                    return None, (
                        f"group {gid} loads position {index}, which is not a null entry of its "
                        "table (or is loaded twice)"
                    )
                seen.add(index)
                slots = (
                    self.tier_pools[tier - 1][self.pool_of_group[gid]]
                    if 1 <= tier <= count
                    else None
                )
                stride = hash_strides[gid]
                if slots is None or slots.caches[gid].get(fine[(index + 1) * stride - 1]) != slot:
                    if not moved:
                        return None, (
                            f"tier {tier} slot {slot} does not hold group {gid}'s block at "
                            f"position {index} of this request"
                        )
                    return gid, None
        return None, None

    # ----------------------------------------------------------------- admission
    def admit_loads(
        self,
        request_id: str | int,
        state: object,
        loads: dict[int, list[tuple[int, int, int]]],
        tables: list[list[int]],
        fine: Sequence[bytes],
        hash_strides: Sequence[int],
        block_tokens: Sequence[int],
    ) -> int:
        """Lock the tier slots of ``loads`` (per group), give each a new device block at its
        position of ``tables``, and record the loads (one transfer per group and tier).
        The caller counted these blocks in its shortfall check. Returns the blocks taken."""
        # Lock every source slot first: taking device blocks may evict into the tiers,
        # and a tier's eviction must not take a slot this admission reads.
        for gid, group_loads in loads.items():
            pool = self.pool_of_group[gid]
            by_tier_slots: dict[int, list[int]] = {}
            for _, tier, slot in group_loads:
                by_tier_slots.setdefault(tier, []).append(slot)
            for tier, tier_slots in by_tier_slots.items():
                slots = self.tier_pools[tier - 1][pool]
                assert slots is not None
                slots.touch(tier_slots, known_cached=True)
        taken_total = 0
        for gid, group_loads in loads.items():
            pool_index = self.pool_of_group[gid]
            device = self.device_pools[pool_index]
            taken = device.take(len(group_loads))
            taken_total += len(taken)
            refs = device.ref_counts
            table = tables[gid]
            stride = hash_strides[gid]
            by_tier: dict[int, _Pending] = {}
            for (index, tier, slot), block in zip(group_loads, taken, strict=True):
                table[index] = block
                refs[block] += 1  # the transfer's own reference
                pending = by_tier.get(tier)
                if pending is None:
                    pending = self._append(LOAD, gid, pool_index, tier, DEVICE_TIER)
                    pending.request_id = request_id
                    pending.request = state
                    pending.first_position = index * block_tokens[gid]
                    by_tier[tier] = pending
                elif index * block_tokens[gid] < pending.first_position:
                    pending.first_position = index * block_tokens[gid]
                pending.source.append(slot)
                pending.destination.append(block)
                pending.hashes.append(fine[(index + 1) * stride - 1])
        return taken_total

    # ----------------------------------------------------------------- the engine's side
    def take(self) -> list[Transfer]:
        """The transfers recorded since the last call, stores of the device's evictions
        first: an evicted block may be one a load of this step fills, so its store must
        read it before (loads are recorded at admission, the evictions' stores here; tier
        slots a load reads are locked, so no store here writes one)."""
        loads = self._queue
        self._queue = []
        for pool, noted in enumerate(self._victims):
            if noted:
                # Emptied in place: the pool's hook appends to this very list.
                victims = noted[:]
                noted.clear()
                if len(victims) == 1:
                    groups, hashes, blocks = victims[0]
                else:
                    groups = [gid for batch in victims for gid in batch[0]]
                    hashes = [digest for batch in victims for digest in batch[1]]
                    blocks = [block for batch in victims for block in batch[2]]
                self._store(0, pool, groups, hashes, DEVICE_TIER, blocks)
        queue = self._queue + loads
        self._queue = []
        for pending in queue:
            pending.taken = True
        return [pending.record() for pending in queue]

    def complete(
        self, transfer_ids: Sequence[int], ok: bool
    ) -> list[tuple[str | int, object, int]]:
        """Confirm (``ok``) or fail the transfers; returns, for failed loads, ``(request
        id, running state, first token position whose content did not arrive)`` per load
        (the caller discards those requests). Refuses unknown, repeated or not yet handed
        out ids with :class:`AllocatorError`, changing nothing."""
        if ok.__class__ is not bool:
            raise AllocatorError(f"complete_transfers: ok={ok!r} must be True or False")
        ids = list(transfer_ids)
        for transfer_id in ids:
            pending = self._pending.get(transfer_id) if transfer_id.__class__ is int else None
            if pending is None or not pending.taken:
                raise AllocatorError(
                    f"complete_transfers: {transfer_id!r} is not the id of a transfer "
                    "take_transfers() handed out and not completed yet"
                )
        if len(set(ids)) != len(ids):
            raise AllocatorError("complete_transfers: a transfer id is given twice")
        failed_loads: list[tuple[str | int, object, int]] = []
        for transfer_id in ids:
            pending = self._pending.pop(transfer_id)
            current = ok and pending.generation == self.generation
            if pending.kind == STORE:
                self._finish_store(pending, current)
            else:
                failed = self._finish_load(pending, current, ok)
                if failed is not None:
                    failed_loads.append(failed)
            if ok:
                key = (pending.source_tier, pending.destination_tier)
                self.blocks_moved[key] = self.blocks_moved.get(key, 0) + len(pending.source)
        return failed_loads

    def _finish_store(self, pending: _Pending, cache: bool) -> None:
        index = pending.destination_tier - 1
        slots = self.tier_pools[index][pending.pool]
        assert slots is not None
        storing = self._storing[index][pending.group]
        if pending.generation == self.generation:
            # Each of its hashes maps to it (no second copy of a hash is sent in flight).
            if len(storing) == len(pending.hashes):
                storing.clear()
            else:
                for digest in pending.hashes:
                    del storing[digest]
        if cache:
            slots.cache_blocks(pending.group, pending.hashes, pending.destination)
        slots._release_unchecked(pending.destination)

    def _finish_load(
        self, pending: _Pending, cache: bool, ok: bool
    ) -> tuple[str | int, object, int] | None:
        device = self.device_pools[pending.pool]
        slots = self.tier_pools[pending.source_tier - 1][pending.pool]
        assert slots is not None
        if cache:
            device.cache_blocks(pending.group, pending.hashes, pending.destination)
        device._release_unchecked(pending.destination)
        if not ok:
            # The copy in the tier could not be read: it leaves the tier (a retry would
            # fail the same way), and the request goes back to its engine.
            for digest, slot in zip(pending.hashes, pending.source, strict=True):
                uncache(slots, pending.group, digest, slot)
        slots._release_unchecked(pending.source)
        if ok or pending.request_id is None:
            return None
        return pending.request_id, pending.request, pending.first_position

    # ----------------------------------------------------------------- the rest
    def reset(self) -> None:
        """Forget every tier's content; copies in flight complete without caching."""
        self.generation += 1
        for victims in self._victims:
            victims.clear()
        for row in self.tier_pools:
            for slots in row:
                if slots is not None:
                    slots.reset_prefix_cache(record_event=False)
        for storing in self._storing:
            for hashes in storing.values():
                hashes.clear()

    def pending_device_refs(self) -> list[dict[int, int]]:
        """Per pool, the references pending loads hold on device blocks (invariants)."""
        refs: list[dict[int, int]] = [{} for _ in self.device_pools]
        for pending in self._pending.values():
            if pending.kind == LOAD:
                held = refs[pending.pool]
                for block in pending.destination:
                    held[block] = held.get(block, 0) + 1
        return refs

    def check_invariants(self) -> None:
        """Each tier's slots against the copies in flight: a slot is referenced exactly by
        the stores writing it and the loads reading it; a slot being written is not
        cached; every cached slot's hash is not also in flight into that tier."""
        expected: list[list[dict[int, int]]] = [[{} for _ in row] for row in self.tier_pools]
        for pending in self._pending.values():
            if pending.kind == STORE:
                held = expected[pending.destination_tier - 1][pending.pool]
                for slot in pending.destination:
                    held[slot] = held.get(slot, 0) + 1
            else:
                held = expected[pending.source_tier - 1][pending.pool]
                for slot in pending.source:
                    held[slot] = held.get(slot, 0) + 1
        for index, row in enumerate(self.tier_pools):
            for pool, slots in enumerate(row):
                if slots is None:
                    continue
                slots.check_invariants()
                for slot in range(1, slots.num_blocks):
                    if slots.ref_counts[slot] != expected[index][pool].get(slot, 0):
                        raise AllocatorError(
                            f"tier {index + 1} pool {pool} slot {slot}: ref count "
                            f"{slots.ref_counts[slot]} but "
                            f"{expected[index][pool].get(slot, 0)} transfers in flight use it"
                        )
        for pending in self._pending.values():
            if pending.kind == STORE:
                slots = self.tier_pools[pending.destination_tier - 1][pending.pool]
                assert slots is not None
                for slot in pending.destination:
                    if slots.cached_hash(slot) is not None:
                        raise AllocatorError(
                            f"tier {pending.destination_tier} slot {slot} is cached while "
                            f"transfer {pending.transfer_id} still writes it"
                        )

    def num_pending(self) -> int:
        return len(self._pending)


def _full_scan(device_scan: HitScan) -> HitScan:
    """Full attention's longest run over a :class:`TieredView`: the run in the device
    cache, then on in the tiers (the same answer as the rules' scan over the view)."""

    def scan(hashes: Sequence[bytes], view: Mapping[bytes, int], max_blocks: int) -> list[int]:
        assert isinstance(view, TieredView)
        found = device_scan(hashes, view.device, max_blocks)
        if len(found) < max_blocks and view.tiers and (found or max_blocks):
            get = view.get
            for digest in hashes[len(found) : max_blocks]:
                block = get(digest)
                if block is None:
                    break
                found.append(block)
        return found

    return scan


def uncache(pool: BlockPool, gid: int, digest: bytes, block: int) -> None:
    """Take ``block`` out of ``pool``'s prefix cache if it is cached there under
    ``digest`` (a referenced block: it stays with its holders and, freed, joins the
    uncached free blocks)."""
    cache = pool.caches[gid]
    if cache.get(digest) == block:
        del cache[digest]
        pool._block_hash[block] = None
        pool._reused[block] = 0
        pool.epoch += 1
