"""The bookkeeping of offload tiers (``TierManager``): which hashes each tier holds in which
slot, the copies the engine has not confirmed yet, and the lookups across tiers.

Each offload tier keeps one :class:`~kvspec_core.runtime.pool.BlockPool` per device pool
(its "blocks" are the tier's slots, with the same per-group ``hash -> slot`` caches and the
same eviction orders), so a tier evicts exactly as the device does. Hooks chain the tiers:

* a device block leaving the prefix cache (pool eviction) is stored in the first tier with
  slots for its pool (write-back on eviction), unless that tier holds its hash already
  (with write-through it usually does: see ``tier_keeping.py``) or the group's keep rules
  say it is not worth keeping;
* a tier's own eviction stores the slot's content in the next tier; the last tier drops it.

A copy is *pending* from the moment it is recorded until the engine confirms it
(``complete_transfers``): its destination holds a reference (never evicted, never handed
out) and is not cached (never a hit). A load also holds a reference on its source slots.
Confirmed, the destination enters its cache; failed, it returns to the free blocks
uncached. An eviction's store does not hold its source: it was evicted and is handed out
right away, which is why the engine runs the transfers, in order, before the step's forward
overwrites it. A write-through copy reads a block still cached and holds a reference on it
until it completes (one evicted before the copy is recorded is stored as the eviction's
victim instead): the device cannot evict it meanwhile, so a failed copy leaves it cached,
to be stored at its eviction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import add, eq, itemgetter, mul, sub
from typing import Any

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.rules import FamilyRules, FullAttentionRules, HitScan
from kvspec_core.runtime.tier_keeping import TierKeeping, drop_cached
from kvspec_core.runtime.tier_lookup import TierLookup
from kvspec_core.runtime.tier_remote import TierRemote
from kvspec_core.runtime.tier_state import PendingTransfer
from kvspec_core.runtime.tier_view import TieredView, full_scan_across_tiers
from kvspec_core.runtime.tiers import DEVICE_TIER, LOAD, STORE, OffloadTier, Transfer

#: A failed load's request: its id, its running state, the first token position whose
#: content did not arrive, and the tokens of its hit (its blocks from there on are its
#: own forward's, cached at its admission).
FailedLoad = tuple[str | int, object, int, int]


class TierManager(TierKeeping, TierLookup, TierRemote):
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
            full_scan_across_tiers(device_scan)
            if getattr(type(group), "longest_hit", None) is FullAttentionRules.longest_hit
            else group.longest_hit
            for group, device_scan in zip(rules, device_scans, strict=True)
        ]
        #: Per offload tier, per group: hash -> id of the store in flight bringing it there.
        self._storing: list[dict[int, dict[bytes, int]]] = [
            {gid: {} for gid in range(len(self.pool_of_group))} for _ in self.tiers
        ]
        self._pending: dict[int, PendingTransfer] = {}
        # Per request id, the TieredPrefix last handed out and what it was made of.
        self._handed: dict[str | int, tuple[object, ...]] = {}
        self._queue: list[PendingTransfer] = []
        self._next_id = 1
        # Bumped by reset_prefix_cache: transfers of an older generation cache nothing.
        self.generation = 0
        #: Blocks confirmed moved, per (source tier, destination tier).
        self.blocks_moved: dict[tuple[int, int], int] = {}
        #: Told ``(group, running state, hashes)`` of each confirmed load as its blocks
        #: enter the device's cache (the allocator's KV events); None: nobody.
        self.on_loaded: Callable[[int, Any, list[bytes]], None] | None = None
        self._init_keeping(rules)

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
        hit_tokens: int,
    ) -> int:
        """Lock the tier slots of ``loads`` (per group), give each a new device block at its
        position of ``tables``, and record the loads (one transfer per group and tier) of a
        hit of ``hit_tokens``. The caller counted these blocks in its shortfall check.
        Returns the blocks taken."""
        # Whole lists at a time: a prefix loads up to thousands of blocks. Per group, per
        # tier in the order the tiers first appear: the table positions and the slots.
        columns: dict[int, dict[int, tuple[list[int], list[int], list[bool] | None]]] = {}
        positions: dict[int, list[int]] = {}
        for gid, group_loads in loads.items():
            indices = positions[gid] = list(map(itemgetter(0), group_loads))
            tiers = list(map(itemgetter(1), group_loads))
            sources = list(map(itemgetter(2), group_loads))
            if not tiers or tiers.count(tiers[0]) == len(tiers):
                columns[gid] = {tiers[0]: (indices, sources, None)} if tiers else {}
                continue
            columns[gid] = {}
            for tier in dict.fromkeys(tiers):
                mask = list(map(eq, tiers, repeat(tier)))
                columns[gid][tier] = (
                    list(compress(indices, mask)),
                    list(compress(sources, mask)),
                    mask,
                )
        # Lock every source slot first: taking device blocks may evict into the tiers,
        # and a tier's eviction must not take a slot this admission reads.
        for gid, by_tier in columns.items():
            pool = self.pool_of_group[gid]
            for tier, (_, tier_slots, _) in by_tier.items():
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
            if len(taken) != len(group_loads):
                raise AllocatorError(
                    f"admit_loads: the device pool gave {len(taken)} of {len(group_loads)} blocks"
                )
            _scatter(table, positions[gid], taken)
            # The transfer's own reference.
            _scatter(refs, taken, map(add, map(refs.__getitem__, taken), repeat(1)))
            stride = hash_strides[gid]
            tokens = block_tokens[gid]
            # One load per tier.
            for tier, (indices, tier_slots, picked) in columns[gid].items():
                pending = self._append(LOAD, gid, pool_index, tier, DEVICE_TIER)
                pending.request_id = request_id
                pending.request = state
                pending.first_position = min(indices) * tokens
                pending.hit_end = hit_tokens
                pending.source.extend(tier_slots)
                pending.destination.extend(taken if picked is None else compress(taken, picked))
                # Each block's hash: the last hash block it covers.
                pending.hashes.extend(
                    map(
                        fine.__getitem__,
                        map(sub, map(mul, indices, repeat(stride)), repeat(1 - stride)),
                    )
                )
        return taken_total

    # ----------------------------------------------------------------- the engine's side
    def take(self, running: Mapping[str | int, Any] | None = None) -> list[Transfer]:
        """The transfers recorded since the last call, stores of the device's evictions
        first: an evicted block may be one a load of this step fills, so its store must
        read it before (loads are recorded at admission, the evictions' stores here; tier
        slots a load reads are locked, so no store here writes one). Then the write-through
        copies of the blocks the last call noted, and the note of ``running``'s blocks
        cached since (``tier_keeping.py``)."""
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
                    groups, hashes, blocks = (
                        list(chain.from_iterable(column)) for column in zip(*victims, strict=True)
                    )
                self._store(0, pool, groups, hashes, DEVICE_TIER, blocks)
        if self._through_groups or self._through_ready:
            self._write_through(running or {})
        queue = self._queue + loads
        self._queue = []
        for pending in queue:
            pending.taken = True
        return [pending.record() for pending in queue]

    def complete(
        self, transfer_ids: Sequence[int], ok: bool, *, checked: bool = False
    ) -> list[FailedLoad]:
        """Confirm (``ok``) or fail the transfers; returns, for failed loads, ``(request
        id, running state, first token position whose content did not arrive, the tokens
        of the request's hit)`` per load (the caller discards those requests). Refuses
        unknown, repeated or not yet handed out ids with :class:`AllocatorError`, changing
        nothing (``checked``: the caller ran :meth:`check_completion` on these very
        arguments, nothing changed since)."""
        ids = list(transfer_ids)
        if not checked:
            self.check_completion(ids, ok)
        failed_loads: list[FailedLoad] = []
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

    def check_completion(self, transfer_ids: Sequence[int], ok: bool) -> list[FailedLoad]:
        """Check :meth:`complete`'s arguments, changing nothing; returns the failed loads
        it would return."""
        if ok.__class__ is not bool:
            raise AllocatorError(f"complete_transfers: ok={ok!r} must be True or False")
        failed_loads: list[FailedLoad] = []
        for transfer_id in transfer_ids:
            if transfer_id.__class__ is not int:
                raise AllocatorError(
                    f"complete_transfers: transfer id {transfer_id!r} must be an int (a "
                    f"Transfer's transfer_id), not {type(transfer_id).__name__}"
                )
            pending = self._pending.get(transfer_id)
            if pending is None or not pending.taken:
                raise AllocatorError(
                    f"complete_transfers: {transfer_id!r} is not the id of a transfer "
                    "take_transfers() handed out and not completed yet"
                )
            if not ok and pending.kind == LOAD and pending.request_id is not None:
                failed_loads.append(
                    (pending.request_id, pending.request, pending.first_position, pending.hit_end)
                )
        if len(set(transfer_ids)) != len(transfer_ids):
            raise AllocatorError("complete_transfers: a transfer id is given twice")
        return failed_loads

    def _finish_store(self, pending: PendingTransfer, cache: bool) -> None:
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
            slots.cache_blocks(pending.group, *_still_valid(pending))
        slots._release_unchecked(pending.destination)
        if pending.held is not None:
            # A write-through copy's device blocks: evictable again (failed, one is stored
            # at its eviction).
            self.device_pools[pending.pool]._release_unchecked(pending.held)

    def _finish_load(self, pending: PendingTransfer, cache: bool, ok: bool) -> FailedLoad | None:
        device = self.device_pools[pending.pool]
        slots = self.tier_pools[pending.source_tier - 1][pending.pool]
        assert slots is not None
        loaded: list[bytes] = []
        if cache:
            loaded, blocks = _still_valid(pending)
            device.cache_blocks(pending.group, loaded, blocks)
        device._release_unchecked(pending.destination)
        if not ok:
            # The copy in the tier could not be read: it leaves the tier (a retry would
            # fail the same way), and the request goes back to its engine.
            for digest, slot in zip(pending.hashes, pending.source, strict=True):
                uncache(slots, pending.group, digest, slot)
        slots._release_unchecked(pending.source)
        if self.on_loaded is not None and loaded:
            # Told once the references are released: nothing it raises can hold them.
            self.on_loaded(pending.group, pending.request, loaded)
        if ok or pending.request_id is None:
            return None
        return pending.request_id, pending.request, pending.first_position, pending.hit_end

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
        self._reset_keeping()

    def pending_device_refs(self) -> list[dict[int, int]]:
        """Per pool, the references transfers in flight hold on device blocks (loads on
        their destinations, write-through copies on their sources; invariants)."""
        refs: list[dict[int, int]] = [{} for _ in self.device_pools]
        for pending in self._pending.values():
            blocks = pending.destination if pending.kind == LOAD else pending.held
            if blocks:
                held = refs[pending.pool]
                for block in blocks:
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


def uncache(pool: BlockPool, gid: int, digest: bytes, block: int) -> None:
    """Take ``block`` out of ``pool``'s prefix cache if it is cached there under
    ``digest`` (a referenced block: it stays with its holders and, freed, joins the
    uncached free blocks)."""
    if pool.caches[gid].get(digest) == block:
        drop_cached(pool, gid, digest, block)


def _still_valid(pending: PendingTransfer) -> tuple[list[bytes], list[int]]:
    """A confirmed copy's ``(hashes, destinations)`` to cache: all of them, but those
    ``discard_uncomputed`` declared never written since it was recorded."""
    dropped = pending.dropped
    if not dropped:
        return pending.hashes, pending.destination
    kept = [
        (digest, block)
        for digest, block in zip(pending.hashes, pending.destination, strict=True)
        if digest not in dropped
    ]
    return [digest for digest, _ in kept], [block for _, block in kept]


def _scatter(target: list[int], positions: Iterable[int], values: Iterable[int]) -> None:
    """``target[position] = value`` for each pair, without a Python step per pair."""
    deque(map(target.__setitem__, positions, values), maxlen=0)
