"""Lookups across tiers: the prefix a lookup over the tiered views finds (loads included),
its hit tokens per tier, and the check of a prefix's loads at admission. Part of
:class:`~kvspec_core.runtime.offloading.TierManager` (see ``tier_state.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from operator import itemgetter

from kvspec_core.runtime.results import CachedPrefix
from kvspec_core.runtime.tier_state import TierState
from kvspec_core.runtime.tiers import TieredPrefix

#: TieredPrefixes handed out and not yet admitted that an admission trusts without the
#: per-load check; past this many, forgotten (their admissions check them).
HANDED_OUT_KEPT = 4096


class TierLookup(TierState):
    """Finding prefixes across tiers and checking them at admission."""

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
            group_loads = _loads_of(ids, count)
            if group_loads:
                # The loaded positions become null entries (a load fills them).
                ids = list(ids)
                for index, _, _ in group_loads:
                    ids[index] = 0
            block_ids.append(tuple(ids))
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
            tokens_by_tier=self._tokens_by_tier(
                hit, found, block_tokens, hash_block_size, count, loads
            ),
            tier_epochs=self.tier_epochs(),
        )

    @staticmethod
    def _tokens_by_tier(
        hit: int,
        found: dict[int, list[int]],
        block_tokens: Sequence[int],
        hash_block_size: int,
        count: int,
        loads: Sequence[Sequence[tuple[int, int, int]]],
    ) -> tuple[int, ...]:
        """Hit tokens per tier (device first): each hash block counts for the slowest tier
        any group takes its content from; a position a group does not need (null) counts
        for the tier of the group's next block. ``loads``: per group, what
        :meth:`prefix` found to load (``(index, tier, slot)``)."""
        (ids,) = found.values() if len(found) == 1 else ([0],)
        gid = next(iter(found))
        if block_tokens[gid] == hash_block_size and 0 not in ids:
            # One group whose blocks are hash blocks, all real (full attention): its loads
            # (found by the caller, one per tier entry) count for their tiers, the rest
            # for the device.
            group_loads = loads[gid]
            counts = [0] * (count + 1)
            if count == 1:
                counts[1] = len(group_loads)
            else:
                for tier, number in Counter(map(itemgetter(1), group_loads)).items():
                    counts[tier] = number
            counts[0] = len(ids) - len(group_loads)
            return tuple(number * hash_block_size for number in counts)
        # Per group, each block's tier spread over its hash blocks; a position counts for
        # the slowest group's.
        length = hit // hash_block_size
        spread = []
        for gid, ids in found.items():
            tiers = _block_tiers(ids, count)
            stride = block_tokens[gid] // hash_block_size
            if stride != 1:
                tiers = [tier for tier in tiers for _ in range(stride)]
            spread.append(tiers[:length] + [0] * (length - len(tiers)))
        slowest = list(map(max, *spread)) if len(spread) > 1 else spread[0]
        totals = [0] * (count + 1)
        for tier, number in Counter(slowest).items():
            totals[tier] = number * hash_block_size
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
            prefix.epochs,
            prefix.num_tokens,
        )

    def handed_out_unchanged(self, request: object, prefix: TieredPrefix) -> bool:
        """Whether ``prefix`` is the very one :meth:`hand_out` remembered for ``request``
        (the same tuples) and no tier evicted since: then every load's slot still holds its
        hash. True forgets it (an admission trusts a handed-out prefix once)."""
        entry = self._handed.get(prefix.request_id)
        if (
            entry is None
            or entry[0] is not prefix
            or entry[1] is not request
            or entry[2] is not prefix.loads
            or entry[3] is not prefix.block_ids
            or entry[4] is not prefix.tier_epochs
            or entry[5] is not prefix.epochs
            or entry[6] is not prefix.num_tokens
            or prefix.tier_epochs != self.tier_epochs()
        ):
            return False
        del self._handed[prefix.request_id]
        return True

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
        if self.handed_out_unchanged(request, prefix):
            # Every load's slot still holds its hash (a tier's cached entries change only
            # with its epoch).
            return None, None
        self._handed.pop(prefix.request_id, None)
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


def _loads_of(table: Sequence[int], count: int) -> list[tuple[int, int, int]]:
    """``(index, tier, slot)`` for each tier entry of a group's hit ``table``, coded
    ``-(slot * count + tier)`` by :func:`~kvspec_core.runtime.tier_view.continued_run`."""
    if not table or min(table) >= 0:
        return []
    if count == 1:
        return [(index, 1, -block - 1) for index, block in enumerate(table) if block < 0]
    return [
        (index, (-block - 1) % count + 1, (-block - 1) // count)
        for index, block in enumerate(table)
        if block < 0
    ]


def _block_tiers(ids: Sequence[int], count: int) -> list[int]:
    """The tier each entry of a group's hit table comes from (0: the device), where a null
    entry (a position the group does not need) counts for the tier of the group's next
    block (0 past its last)."""
    if count == 1:
        tiers = [1 if block < 0 else 0 for block in ids]
    else:
        tiers = [(-block - 1) % count + 1 if block < 0 else 0 for block in ids]
    if 0 in ids:
        after = 0
        for index in range(len(ids) - 1, -1, -1):
            if ids[index]:
                after = tiers[index]
            else:
                tiers[index] = after
    return tiers
