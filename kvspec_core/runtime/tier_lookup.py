"""Lookups across tiers: the prefix a lookup over the tiered views finds (loads included),
its hit tokens per tier, and the check of a prefix's loads at admission. Part of
:class:`~kvspec_core.runtime.offloading.TierManager` (see ``tier_state.py``)."""

from __future__ import annotations

from collections.abc import Sequence

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
            table = list(ids)
            # A tier's slot is coded as -(slot * count + tier number): see continued_run.
            if not table or min(table) >= 0:
                group_loads = []
            elif count == 1:
                group_loads = [
                    (index, 1, -block - 1) for index, block in enumerate(table) if block < 0
                ]
            else:
                group_loads = [
                    (index, (-block - 1) % count + 1, (-block - 1) // count)
                    for index, block in enumerate(table)
                    if block < 0
                ]
            for index, _, _ in group_loads:
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
