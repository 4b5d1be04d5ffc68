"""The engine's side of offload tiers: ``take_transfers`` and ``complete_transfers``.

The ordering contract (an engine step with tiers)::

    prefix = allocator.find_cached_prefix(request)   # may be a TieredPrefix
    allocator.allocate_slots(request, n, prefix=prefix)
    ...                                             # every allocate_slots of the step
    transfers = allocator.take_transfers()          # what the step's calls recorded
    for transfer in transfers:                      # in this order, before the forward:
        run(transfer)                               # a store reads a block the step may
    failed = allocator.complete_transfers(          # overwrite; a load fills one it reads
        [t.transfer_id for t in transfers_done], ok=True)
    allocator.complete_transfers(ids_that_failed, ok=False)  # -> the requests to drop
    forward(...)                                    # without the requests returned

A transfer not confirmed is pending: its destination is neither a hit nor evictable.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.base import AllocatorBase
from kvspec_core.runtime.freeing import Freeing
from kvspec_core.runtime.hashing import DIGEST_SIZE
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.tier_remote import RemoteReservation
from kvspec_core.runtime.tiers import Transfer


class TierTransfers(Freeing, AllocatorBase):
    """``take_transfers``, ``complete_transfers`` (part of ``KVCacheAllocator``)."""

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The tiers' names by number: ``"device"`` then the offload tiers'."""
        tiers = self._tiers
        return ("device",) + (() if tiers is None else tuple(tier.name for tier in tiers.tiers))

    def block_counts(self) -> dict[tuple[int, int], int]:
        """``(tier, pool) -> blocks`` of every pool, the device's (tier 0, the null block
        included) and each offload tier's that holds it: the dim 0 a transfer's storage
        indexes (``TransferRunner.check_storage``)."""
        counts = {(0, pool): device.num_blocks for pool, device in enumerate(self.pools)}
        if self._tiers is not None:
            for index, row in enumerate(self._tiers.tier_pools):
                for pool, slots in enumerate(row):
                    if slots is not None:
                        counts[(index + 1, pool)] = slots.num_blocks
        return counts

    def take_transfers(self) -> list[Transfer]:
        """The copies recorded since the last call, in the order the engine must run them
        (all before the forward of the step whose ``allocate_slots`` recorded them): loads
        of admitted tier hits, and stores of blocks the step evicted (device -> first tier,
        tier -> next tier). With a write-through tier (``OffloadTier.write_policy``), also
        the copies of blocks cached by requests allocated again or freed since (their
        forward ran: the copies read what it wrote). Call it after the step's
        ``allocate_slots`` calls and before its forward, once per step or after each
        admission. Empty without tiers."""
        if self._tiers is None:
            return []
        return self._tiers.take(self._running)

    def complete_transfers(
        self, transfer_ids: Iterable[int], ok: bool = True
    ) -> tuple[str | int, ...]:
        """Confirm transfers the engine ran (``ok=True``: their destinations become hits)
        or report them failed (``ok=False``: their destinations return to the free blocks,
        uncached, nothing else lost; a failed load's source leaves its tier).

        Returns the requests a failed load was admitted for that are still running, then
        every running request that reused a block one of their discards uncaches (admitted
        in the same step, it hit a block the failed request was to compute: its forward
        would read content nobody writes), and so on for those: each was discarded
        (``discard_uncomputed`` from the first position whose content did not arrive, or
        from the first block it reused of a discarded request's: no block after it stays
        cached) and freed. The engine must not run their forward in this step and may
        admit them again (``find_cached_prefix``).
        Refuses ids not handed out by :meth:`take_transfers`, or completed already, and a
        keep rule's bad answer for a request to discard (``offload_range``), with
        :class:`AllocatorError`, changing nothing."""
        if self._tiers is None:
            ids = list(transfer_ids)
            if ids:
                raise AllocatorError(
                    "complete_transfers: this allocator has no offload tiers, so no transfer "
                    f"ids ({ids[:3]!r}...) to complete"
                )
            return ()
        ids = list(transfer_ids)
        first_lost: dict[str | int, int] = {}
        unwritten_from: dict[str | int, int] = {}
        for request_id, state, position, hit_end in self._tiers.check_completion(ids, ok):
            if self._running.get(request_id) is state:
                first_lost[request_id] = min(position, first_lost.get(request_id, position))
                unwritten_from[request_id] = hit_end
        if first_lost:
            first_lost = self._with_sharers(first_lost, unwritten_from)
        # Every discard's keep marks are asked before anything changes: a keep rule's bad
        # answer refuses the call with the loads still pending and every request running.
        marks = {
            request_id: self._keep_marks(self._running[request_id]) for request_id in first_lost
        }
        # Checked above, unless keep rules (plugin code) ran since.
        self._tiers.complete(ids, ok, checked=not first_lost)
        for request_id, position in first_lost.items():
            state = self._running[request_id]
            self._discard(request_id, state, min(position, state.computed), marks[request_id])
        return tuple(first_lost)

    def _with_sharers(
        self, first_lost: dict[str | int, int], unwritten_from: dict[str | int, int]
    ) -> dict[str | int, int]:
        """``first_lost`` (running request -> the first position whose content did not
        arrive) with every running request that reused a block one of those requests was
        to compute (``unwritten_from``: its hit's tokens; its blocks from there on were
        cached at its admission, before its forward), from the first such block on, and so
        on for those (their blocks from there on count as unwritten), until no discard
        reaches another request. The blocks of a hit stay valid for their other holders.
        Reads only: the discards run after every keep rule was asked."""
        lost = dict(first_lost)
        unwritten = dict(unwritten_from)
        running = self._running
        queue = list(lost)
        while queue:
            request_id = queue.pop()
            state = running[request_id]
            position = max(lost[request_id], unwritten.get(request_id, 0))
            doomed: dict[int, set[int]] = {}
            for gid in self._holding:
                block_hash = self._group_pools[gid]._block_hash
                tail = state.blocks[gid][position // self._block_tokens[gid] :]
                cached = {block for block in tail if block and block_hash[block] is not None}
                if cached:
                    doomed[gid] = cached
            if not doomed:
                continue
            for other_id, reused_from in self._reusers(doomed).items():
                if other_id != request_id and reused_from < lost.get(other_id, reused_from + 1):
                    lost[other_id] = unwritten[other_id] = reused_from
                    queue.append(other_id)
        return lost

    # ----------------------------------------------------------------- remote blocks
    def block_hashes(self, request: Request, group: int) -> tuple[bytes, ...]:
        """The hashes group ``group``'s full blocks of ``request``'s prompt (all tokens but
        the last, as :meth:`find_cached_prefix` looks up) are cached under, in order: what a
        remote store shared by replicas keys them by (``remote_tier.py``)."""
        self._check_group(group, "block_hashes")
        if request.request_id in self._running:
            raise AllocatorError(
                f"block_hashes: request {request.request_id!r} is already running; ask before "
                "its first allocate_slots"
            )
        stride = self._hash_stride[group]
        max_tokens = max(0, self._lookup_limit(request))
        fine = self._hasher.hashes(request, max_tokens)[: max_tokens // self.hash_block_size]
        return tuple(fine[stride - 1 :: stride])

    def reserve_remote_blocks(
        self,
        group: int,
        block_hashes: Sequence[bytes],
        local_hit: Sequence[bytes] | Mapping[int, Sequence[bytes]] = (),
    ) -> RemoteReservation | None:
        """Reserve slots of the first offload tier with slots for ``group``'s pool for blocks
        fetched from a remote store under ``block_hashes`` (a chain in order; see
        ``tier_remote.py``). The reservation's ``transfer.destination_blocks`` are the slots
        for the leading ``block_hashes`` it names (it stops at a hash the device or a tier
        holds or has in flight, and at the tier's free or evictable slots); its
        ``demotions`` copy the entries it evicted to the tiers below. In this order: run
        the demotions and complete them (``ok`` or not), write the pages into the slots,
        then ``complete_transfers([reservation.transfer.transfer_id], ok=...)`` (``ok=True``
        caches them under these hashes, ``ok=False`` frees them uncached). Pending, the
        slots are neither hits nor evictable. None when nothing is reserved (no new hash,
        or a copy out of that tier is still pending: run the step's transfers first).
        ``local_hit``: the chain's hashes before ``block_hashes`` (the request's local hit),
        or per group the hashes the request's hit needs (a hybrid: every group's local and
        fetched blocks); the reservation evicts none of the tiers' entries for them, so the
        fetched blocks still continue that hit."""
        self._check_group(group, "reserve_remote_blocks")
        if self._tiers is None:
            raise AllocatorError(
                "reserve_remote_blocks: this allocator has no offload tiers; give it "
                "offload_tiers=(OffloadTier('host', n),) to hold blocks fetched remotely"
            )
        hashes = list(block_hashes)
        local = (
            {gid: list(values) for gid, values in local_hit.items()}
            if isinstance(local_hit, Mapping)
            else {group: list(local_hit)}
        )
        checked = [("block_hashes", hashes)]
        for gid, values in local.items():
            self._check_group(gid, "reserve_remote_blocks (local_hit)")
            checked.append((f"local_hit[{gid}]", values))
        for name, values in checked:
            for index, digest in enumerate(values):
                if digest.__class__ is not bytes or len(digest) != DIGEST_SIZE:
                    raise AllocatorError(
                        f"reserve_remote_blocks: {name}[{index}] must be {DIGEST_SIZE} bytes "
                        f"(a hash of block_hashes()), not {type(digest).__name__}"
                    )
        if len(set(hashes)) != len(hashes):
            first: dict[bytes, int] = {}
            for index, digest in enumerate(hashes):
                if digest in first:
                    raise AllocatorError(
                        f"reserve_remote_blocks: block_hashes[{index}] repeats "
                        f"block_hashes[{first[digest]}]; a chain's hashes are distinct (each "
                        "names the whole prefix up to its block): pass a run of "
                        "block_hashes()"
                    )
                first[digest] = index
        return self._tiers.reserve_remote(group, hashes, local)

    def tier_holds(self, transfer: Transfer) -> list[bool]:
        """Per block of ``transfer`` (a completed store into a tier), whether that tier
        caches the block's hash in the transfer's destination slot now: what may be read
        back and published under that hash (``RemoteTier.publish``). A completed copy is not
        always cached: a write-through copy of a block ``discard_uncomputed`` declared
        unwritten is dropped, and a slot may have been evicted and reused since."""
        if self._tiers is None:
            raise AllocatorError("tier_holds: this allocator has no offload tiers")
        if len(transfer.block_hashes) != len(transfer.destination_blocks):
            raise AllocatorError(
                f"tier_holds: transfer {transfer.transfer_id} names "
                f"{len(transfer.block_hashes)} hashes for {len(transfer.destination_blocks)} "
                "blocks"
            )
        return self._tiers.holds_stored(transfer)

    def plan_remote_fetch(
        self, request: Request, remote: Mapping[int, Collection[bytes]]
    ) -> tuple[int, dict[int, list[bytes]]]:
        """The hit ``request`` would find if the blocks a remote store has were local, and
        what to fetch for it: ``(hit tokens, {group: hashes to fetch, in block order}))``.

        ``remote`` names, per group, hashes of :meth:`block_hashes` the store has. The
        groups' rules decide over their device and tier entries and those hashes together
        (the coordinator's fixed point, as :meth:`find_cached_prefix` does), so every group
        can resume at the hit from what is local or fetched; the hashes to fetch are the
        remote-only blocks the hit needs (a sliding window: its window's, not the blocks
        before it). A hit no longer than the local one asks for nothing."""
        if self._tiers is None:
            raise AllocatorError(
                "plan_remote_fetch: this allocator has no offload tiers to fetch into"
            )
        if request.request_id in self._running:
            raise AllocatorError(
                f"plan_remote_fetch: request {request.request_id!r} is already running"
            )
        max_tokens = self._lookup_limit(request)
        if not self._cacheable or max_tokens < self.hash_block_size:
            return 0, {}
        fine = self._hasher.hashes(request, max_tokens)
        views = [
            _WithRemote(view, remote.get(gid, ())) for gid, view in enumerate(self._tiers.views)
        ]
        hit, found, _ = self._coordinator.find(fine, max_tokens, views, self._coordinator.hit_scans)
        wanted: dict[int, list[bytes]] = {}
        for gid, blocks in found.items():
            stride = self._hash_stride[gid]
            hashes = [
                fine[(index + 1) * stride - 1]
                for index, block in enumerate(blocks[: hit // self._block_tokens[gid]])
                if block == _REMOTE
            ]
            if hashes:
                wanted[gid] = hashes
        return hit, wanted

    def _check_group(self, group: object, method: str) -> None:
        if group.__class__ is not int or not 0 <= group < len(self.specs):
            raise AllocatorError(
                f"{method}: group={group!r} must be a group index 0..{len(self.specs) - 1}"
            )


#: What a :class:`_WithRemote` view gives for a hash only the remote store has: no block id
#: (those are below 2**32) and no tier code (negative).
_REMOTE = 1 << 62


class _WithRemote(Mapping[bytes, int]):
    """A group's tiered view plus the hashes a remote store has (:data:`_REMOTE`)."""

    __slots__ = ("remote", "view")

    def __init__(self, view: Mapping[bytes, int], remote: Collection[bytes]) -> None:
        self.view = view
        self.remote = remote

    def __getitem__(self, digest: bytes) -> int:
        found = self.view.get(digest)
        if found is not None:
            return found
        if digest in self.remote:
            return _REMOTE
        raise KeyError(digest)

    def __iter__(self) -> Iterator[bytes]:
        yield from self.view
        for digest in self.remote:
            if digest not in self.view:
                yield digest

    def __len__(self) -> int:
        return sum(1 for _ in self)
