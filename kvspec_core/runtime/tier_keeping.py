"""What goes below the device, and when: write-through copies of the blocks that entered the
device's prefix cache, and the families' rules of which blocks are worth keeping in slower
tiers. Part of :class:`~kvspec_core.runtime.offloading.TierManager` (see ``tier_state.py``).

**Write-through** (``OffloadTier.write_policy="write_through"`` on the tier a pool's device
blocks go to). A block enters the prefix cache in ``allocate_slots``, before the forward
that writes it, and ``take_transfers()`` is run before that forward: so a take notes the
blocks cached since the last one (from the running requests' cached-block progress, which
the compiled kernels advance too), each with its request and the request's computed tokens
then, and a note is copied only once the engine shows that forward ran: the request was
allocated again (its computed tokens moved: an engine schedules a request again only after
its forward) or freed. Nothing assumes how often the engine takes: several takes in one
step (transfers run after each admission) copy nothing early. A noted block is copied only
if it is still cached under the same hash then (one evicted meanwhile was stored as the
eviction's victim, which reads it before it is overwritten). A block the engine declares
never written (``discard_uncomputed``) is no longer copied; if its copy was recorded
already, the copy caches nothing of it, and a tier that holds it from that copy forgets
it: a block uncached on the device never becomes a tier hit through write-through.

**Keep rules** (``OffloadTier.keep="family_rules"`` on the tier a pool's device blocks go
to, and a group whose rules define the optional ``offload_range``, see
:mod:`kvspec_core.plugins.family_rules`). When a request is freed the rules name the
entries of its table worth keeping below the device (a sliding window: its last window);
those blocks are marked with the hash they are cached under. When the device evicts a
cached block of such a group, it is stored in the tiers only if so marked (under that very
hash); a block the request released earlier (skipped mid-request, out of its window) is
dropped. Storing less never creates a hit: the group's own rules decide hits over what
the tiers hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.tier_storing import TierStoring
from kvspec_core.runtime.tiers import (
    DEVICE_TIER,
    KEEP_EVERYTHING,
    KEEP_FAMILY_RULES,
    WRITE_BACK,
    WRITE_THROUGH,
)


class TierKeeping(TierStoring):
    """Write-through copies and the families' keep rules (see the module docstring)."""

    def _init_keeping(self, rules: Sequence[object]) -> None:
        """Set up both from the tiers' ``write_policy`` and the groups' rules."""
        first_tier = [
            next(
                (index for index, row in enumerate(self.tier_pools) if row[pool] is not None), None
            )
            for pool in range(len(self.device_pools))
        ]
        for index, tier in enumerate(self.tiers):
            for field, value, default in (
                ("write_policy", tier.write_policy, WRITE_BACK),
                ("keep", tier.keep, KEEP_EVERYTHING),
            ):
                if value != default and index not in first_tier:
                    raise AllocatorError(
                        f"offload_tiers[{index}] ({tier.name!r}): {field}={value!r} applies to "
                        "the tier the device's blocks are copied to (the first with slots for "
                        "a pool), and no pool's first tier is this one; set it on "
                        "offload_tiers[0] (a tier below receives what the tier above evicts)"
                    )
        #: Per device pool: whether its blocks are written through to its first tier.
        self._through = [
            first is not None and self.tiers[first].write_policy == WRITE_THROUGH
            for first in first_tier
        ]
        #: Per group whose pool's first tier keeps what the family rules say, and whose
        #: rules define ``offload_range``: its rules.
        self._keep_rules = {
            gid: group_rules
            for gid, group_rules in enumerate(rules)
            if getattr(group_rules, "offload_range", None) is not None
            and (first := first_tier[self.pool_of_group[gid]]) is not None
            and self.tiers[first].keep == KEEP_FAMILY_RULES
        }
        for gid, group_rules in self._keep_rules.items():
            offload_range = group_rules.offload_range  # type: ignore[attr-defined]
            if not callable(offload_range):
                raise AllocatorError(
                    f"group {gid}'s rules ({type(group_rules).__name__}): offload_range="
                    f"{offload_range!r} is not callable (the tier's keep='family_rules' asks "
                    "it which blocks a freed request keeps); define it as a method "
                    "offload_range(num_cached) -> (start, stop), or leave it out to keep "
                    "everything"
                )
        #: Per device pool: block -> the hash it was cached under when a free marked it
        #: worth keeping below the device (groups with keep rules only).
        self._kept = [{} for _ in self.device_pools]
        for pool in {self.pool_of_group[gid] for gid in self._keep_rules}:
            self.device_pools[pool]._on_evict = self._keeping_deferrer(pool)
        #: Groups whose blocks are written through (a group with keep rules is stored at
        #: eviction, when its rules have said which blocks are worth it).
        self._through_groups = [
            gid
            for gid, pool in enumerate(self.pool_of_group)
            if self._through[pool] and gid not in self._keep_rules
        ]
        #: Per running request id: (its running state, per group the table entries noted).
        self._through_marks = {}
        #: The blocks takes noted, not copied yet: ``(request id, its running state, its
        #: computed tokens when noted, group, blocks, their hashes)``, copied by the first
        #: take after the request was allocated again or freed (its forward then ran).
        self._through_ready = []
        #: Per device pool: block -> the hash a write-through copy of it was recorded for
        #: (what discard_uncomputed takes back from the tiers).
        self._through_from = [{} for _ in self.device_pools]

    # ----------------------------------------------------------------- keep rules
    def _keeping_deferrer(self, pool: int) -> Callable[[list[int], list[bytes], list[int]], None]:
        """The device pool's eviction hook when some group of it has keep rules: note the
        victims worth keeping (stored by ``take``), drop the others."""
        append = self._victims[pool].append
        kept = self._kept[pool]
        keep_rules = self._keep_rules

        def evicted(groups: list[int], hashes: list[bytes], blocks: list[int]) -> None:
            pop = kept.pop
            # Every victim's mark goes (its block leaves the cache); a group without keep
            # rules keeps everything.
            keep = [
                pop(block, None) == digest or gid not in keep_rules
                for gid, digest, block in zip(groups, hashes, blocks, strict=True)
            ]
            if all(keep):
                append((groups, hashes, blocks))
            elif any(keep):
                append(
                    (
                        [gid for gid, wanted in zip(groups, keep, strict=True) if wanted],
                        [digest for digest, wanted in zip(hashes, keep, strict=True) if wanted],
                        [block for block, wanted in zip(blocks, keep, strict=True) if wanted],
                    )
                )

        return evicted

    def keep_marks(self, state: Any) -> list[tuple[dict[int, bytes], BlockPool, list[int]]]:
        """Ask each keep rule which entries of a request's table are worth keeping below
        the device, changing nothing: the marks :meth:`mark_kept` sets when the request is
        freed. Every path that frees (``free``, ``discard_uncomputed``, failed loads) asks
        before it changes anything, so a rule's bad answer, or its exception, refuses the
        call with nothing half-applied."""
        marks: list[tuple[dict[int, bytes], BlockPool, list[int]]] = []
        for gid, group_rules in self._keep_rules.items():
            table = state.blocks[gid]
            if not table:
                continue
            num_cached = state.num_cached[gid]
            asked = (
                f"group {gid}'s rules ({type(group_rules).__name__}.offload_range({num_cached}))"
            )
            try:
                answer = group_rules.offload_range(num_cached)  # type: ignore[attr-defined]
            except Exception as error:
                raise AllocatorError(
                    f"{asked} raised {type(error).__name__}: {error}; nothing was freed; fix "
                    "the plugin's offload_range"
                ) from error
            if (
                answer.__class__ is not tuple
                or len(answer) != 2
                or any(value.__class__ is not int for value in answer)
                or not 0 <= answer[0] <= answer[1] <= num_cached
            ):
                raise AllocatorError(
                    f"{asked} answered {answer!r}: it must be a (start, stop) tuple of "
                    f"ints with 0 <= start <= stop <= {num_cached} (the cached entries); fix "
                    "the plugin's offload_range"
                )
            pool = self.pool_of_group[gid]
            marks.append((self._kept[pool], self.device_pools[pool], table[answer[0] : answer[1]]))
        return marks

    @staticmethod
    def mark_kept(marks: list[tuple[dict[int, bytes], BlockPool, list[int]]]) -> None:
        """Mark the blocks :meth:`keep_marks` named with the hash each is cached under now
        (one uncached since, by ``discard_uncomputed``, is not marked)."""
        for kept, device, blocks in marks:
            block_hash = device._block_hash
            for block in blocks:
                if block:
                    digest = block_hash[block]
                    if digest is not None:
                        kept[block] = digest

    # ----------------------------------------------------------------- write-through
    def _write_through(self, running: Mapping[str | int, Any]) -> None:
        """Record the copies of the noted blocks whose forward has run (still cached under
        their hash), then note the blocks cached since (see the module docstring)."""
        pool_of = self.pool_of_group
        pools = self.device_pools
        if self._through_ready:
            due: dict[int, tuple[list[int], list[bytes]]] = {}
            waiting: list[tuple[str | int, Any, int, int, list[int], list[bytes]]] = []
            for note in self._through_ready:
                request_id, state, computed, gid, blocks, hashes = note
                if state.computed == computed and running.get(request_id) is state:
                    # No allocation since the note: its forward may not have run yet.
                    waiting.append(note)
                    continue
                batch = due.get(gid)
                if batch is None:
                    due[gid] = (list(blocks), list(hashes))
                else:
                    batch[0].extend(blocks)
                    batch[1].extend(hashes)
            self._through_ready = waiting
            for gid, (blocks, hashes) in due.items():
                pool = pool_of[gid]
                now = list(map(pools[pool]._block_hash.__getitem__, blocks))
                if now != hashes:
                    # Some left the cache since (evicted: stored as victims; discarded).
                    kept = [
                        (block, digest)
                        for block, digest, held in zip(blocks, hashes, now, strict=True)
                        if held == digest
                    ]
                    blocks = [block for block, _ in kept]
                    hashes = [digest for _, digest in kept]
                if blocks:
                    queued = {id(pending): len(pending.source) for pending in self._queue}
                    self._store(0, pool, [gid] * len(blocks), hashes, DEVICE_TIER, blocks)
                    self._hold_sources(pool, queued)
                    # What discard_uncomputed takes back from the tiers. A block the tier
                    # held already (refreshed) is named too: its copy there may then be
                    # dropped needlessly, never kept wrongly.
                    self._through_from[pool].update(zip(blocks, hashes, strict=True))
        groups = self._through_groups
        if not groups:
            return
        marks = self._through_marks
        fresh: dict[str | int, tuple[object, list[int]]] = {}
        noted = self._through_ready
        for request_id, state in running.items():
            entry = marks.get(request_id)
            upto = entry[1] if entry is not None and entry[0] is state else [0] * len(pool_of)
            num_cached = state.num_cached
            for gid in groups:
                stop = num_cached[gid]
                start = upto[gid]
                if stop > start:
                    upto[gid] = stop
                    table = state.blocks[gid][start:stop]
                    found: list[Any] = list(map(pools[pool_of[gid]]._block_hash.__getitem__, table))
                    if None in found:
                        # Null entries, blocks whose hash another block holds, loads.
                        kept = [
                            (block, digest)
                            for block, digest in zip(table, found, strict=True)
                            if digest is not None
                        ]
                        table = [block for block, _ in kept]
                        found = [digest for _, digest in kept]
                    if table:
                        noted.append((request_id, state, state.computed, gid, table, found))
            fresh[request_id] = (state, upto)
        self._through_marks = fresh

    def _hold_sources(self, pool: int, queued: dict[int, int]) -> None:
        """Reference the device blocks the copies just recorded read (``queued``: the
        sources each transfer queued before had), until each copy completes: so a failed
        copy leaves its block on the device, to be stored at its eviction."""
        device = self.device_pools[pool]
        refs = device.ref_counts
        reused = device._reused
        for pending in self._queue:
            if pending.source_tier != DEVICE_TIER or pending.pool != pool:
                continue
            new = pending.source[queued.get(id(pending), 0) :]
            if not new:
                continue
            for block in new:
                if not refs[block]:
                    # A cached free block leaves the eviction order while the copy reads it.
                    if reused[block]:
                        del device._protected[block]
                    else:
                        del device._evictable[block]
                refs[block] += 1
            if pending.held is None:
                pending.held = list(new)
            else:
                pending.held.extend(new)

    def forget_notes(self, state: Any, unwritten: Mapping[int, Sequence[int]]) -> None:
        """``discard_uncomputed`` freed ``state``, whose blocks ``unwritten`` (per group)
        were never written: none of its write-through notes of them is copied, even of a
        block whose hash another block took meanwhile (uncached, so
        :meth:`forget_unwritten` does not name it): that block may be cached again under
        the same hash before the next take, by a request whose forward has not run yet."""
        notes = self._through_ready
        for index, note in enumerate(notes):
            if note[1] is state and note[3] in unwritten:
                gone = set(unwritten[note[3]])
                if not gone.isdisjoint(note[4]):
                    notes[index] = _note_without(note, partial(_in_blocks, gone))

    def forget_unwritten(self, gid: int, digests: Sequence[bytes], blocks: Sequence[int]) -> None:
        """``discard_uncomputed`` took ``blocks`` of group ``gid`` (cached under
        ``digests``) out of the device's cache: their content was never written. No
        write-through copy of them is recorded from now on, one recorded caches nothing of
        them, and a tier holding one from such a copy forgets it."""
        pool = self.pool_of_group[gid]
        if not self._through[pool]:
            return
        gone = dict(zip(blocks, digests, strict=True))
        notes = self._through_ready
        was_gone = partial(_is_gone, gone)
        for index, note in enumerate(notes):
            if note[3] == gid and any(map(was_gone, note[4], note[5])):
                notes[index] = _note_without(note, was_gone)
        written = self._through_from[pool]
        # An ordered dict, not a set: the slots dropped below return to the tier's free stack
        # in this order, which must not depend on PYTHONHASHSEED (found by review).
        unwritten: dict[bytes, None] = {}
        for block, digest in gone.items():
            if written.get(block) == digest:
                del written[block]
                unwritten[digest] = None
        if not unwritten:
            return
        for pending in self._pending.values():
            if pending.group == gid and not unwritten.keys().isdisjoint(pending.hashes):
                pending.dropped = (pending.dropped or set()) | (
                    unwritten.keys() & set(pending.hashes)
                )
        for row in self.tier_pools:
            slots = row[pool]
            if slots is None:
                continue
            cache = slots.caches[gid]
            for digest in unwritten:
                slot = cache.get(digest)
                if slot is not None:
                    drop_cached(slots, gid, digest, slot)

    def _reset_keeping(self) -> None:
        self._through_ready = []
        for written in self._through_from:
            written.clear()
        for kept in self._kept:
            kept.clear()


_Note = tuple[str | int, Any, int, int, list[int], list[bytes]]


def _is_gone(gone: dict[int, bytes], block: int, digest: bytes) -> bool:
    return gone.get(block) == digest


def _in_blocks(blocks: set[int], block: int, _digest: bytes) -> bool:
    return block in blocks


def _note_without(note: _Note, dropped: Callable[[int, bytes], bool]) -> _Note:
    """A write-through note (see ``TierKeeping._through_ready``) less the blocks
    ``dropped(block, hash)`` names."""
    request_id, state, computed, gid, blocks, hashes = note
    kept = [
        (block, digest)
        for block, digest in zip(blocks, hashes, strict=True)
        if not dropped(block, digest)
    ]
    return request_id, state, computed, gid, [b for b, _ in kept], [d for _, d in kept]


def drop_cached(pool: BlockPool, gid: int, digest: bytes, block: int) -> None:
    """Take ``block``, cached under ``digest`` for ``gid``, out of ``pool``'s prefix cache:
    a referenced block stays with its holders (uncached; freed, it joins the plain free
    blocks), a free one becomes a plain free block at once."""
    del pool.caches[gid][digest]
    pool._block_hash[block] = None
    if not pool.ref_counts[block]:
        if pool._reused[block]:
            del pool._protected[block]
        else:
            del pool._evictable[block]
        pool._fresh.append(block)
    pool._reused[block] = 0
    pool.epoch += 1
