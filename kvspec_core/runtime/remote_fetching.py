"""Fetching: a :class:`~kvspec_core.runtime.remote_tier.RemoteTier`'s job of bringing a
request's blocks from the shared store into a local tier before its lookup (see
``remote_tier.py``'s module docstring, *Fetching* and *Hybrids*)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.remote_tier_state import RemoteTierState
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.tier_remote import RemoteReservation


class RemoteFetching(RemoteTierState):
    """:meth:`fetch` and the writing of fetched pages into the reserved tier slots."""

    def fetch(self, request: Request) -> int:
        """Bring the request's blocks after its local hit from the store into a local tier,
        before ``find_cached_prefix``; returns how many now lie there (0 on any miss, a
        server down or slow, a running request, nothing to fetch)."""
        allocator = self.allocator
        if allocator.is_running(request.request_id):
            return 0
        self._bind_block_layouts()
        if self._planned:
            return self._fetch_planned(request)
        hashes = allocator.block_hashes(request, self.group)
        local = allocator.find_cached_prefix(request).num_tokens
        start = local // allocator.rules[self.group].block_tokens
        wanted = list(hashes[start : start + self.max_fetch_blocks])
        remembered = self.misses.first_missed(wanted)
        if remembered < len(wanted):
            # Missed a moment ago: the run ends there without asking the server again.
            self.counters.remembered_miss_hits += 1
            self.counters.fetches_not_asked += remembered == 0
            del wanted[remembered:]
        if not wanted:
            return 0
        store = self.store
        run = store.contained_prefix_length(wanted)
        if run < len(wanted) and store.last_call_answered:
            self._remember_miss(wanted[run])
        if run == 0:
            return 0
        block_bytes = self._page_bytes(self.group)
        pages = store.get_many(wanted[:run], max_payload_bytes=block_bytes)
        # A page of another size (a valid value of another layout under this namespace) is
        # refused here, before any slot is reserved: a reservation evicts tier entries.
        usable = _leading_fits(pages, block_bytes)
        good = len(usable)
        self.counters.fetch_misses += run - good
        if good < run and store.last_call_answered:
            self._remember_miss(wanted[good])  # gone since, corrupt, or of another size
        if good == 0:
            return 0
        reservation = allocator.reserve_remote_blocks(
            self.group, wanted[:good], local_hit=hashes[:start]
        )
        if reservation is None:
            return 0
        return self._write(reservation, usable, block_bytes)

    def _page_bytes(self, gid: int) -> int:
        """Bytes of a block of group ``gid`` in the tier its fetched blocks land in: the only
        page size that can be written (a longer value is not even read)."""
        self.runner.prepare(self.allocator)
        return self.runner.block_bytes(self._fetch_tiers[gid], self.allocator._pool_of[gid])

    def _remember_miss(self, digest: bytes) -> None:
        self.counters.misses_remembered += self.misses.remember([digest])

    def _fetch_planned(self, request: Request) -> int:
        """:meth:`fetch` for hybrids (or one group that is not full attention): ask each
        group's store which of its blocks around the local hit it has, let the groups'
        rules find the hit those would give (``plan_remote_fetch``: every group resumes
        there), and fetch only what that hit needs (a sliding window: its window's blocks;
        Mamba: the state at the hit). Any block missing or refused ends the fetch with
        nothing written."""
        allocator = self.allocator
        local = allocator.find_cached_prefix(request).num_tokens
        chains = {gid: allocator.block_hashes(request, gid) for gid in self.stores}
        available: dict[int, set[bytes]] = {}
        remembered_any = False
        for gid, chain in chains.items():
            block_tokens = allocator.rules[gid].block_tokens
            first = max(0, local // block_tokens - self.max_fetch_blocks)
            asked = list(chain[first : local // block_tokens + self.max_fetch_blocks])
            misses = self.misses_by_group[gid]
            known = misses.first_missed(asked)
            if known < len(asked):
                remembered_any = True
                asked = [digest for digest in asked if not misses.remembers(digest)]
            if not asked:
                continue
            store = self.stores[gid]
            present = store.contains_many(asked)
            if store.last_call_answered:
                absent = [digest for digest, has in zip(asked, present, strict=True) if not has]
                self.counters.misses_remembered += misses.remember(absent)
            available[gid] = {digest for digest, has in zip(asked, present, strict=True) if has}
        # Per fetch, as documented (not per group whose run met a remembered miss).
        self.counters.remembered_miss_hits += remembered_any
        if not available:
            self.counters.fetches_not_asked += remembered_any
            return 0
        hit, wanted = allocator.plan_remote_fetch(request, available)
        if hit <= local or not wanted:
            return 0
        # Every group's pages are fetched and checked before any slot is reserved: a refused
        # one ends the fetch with nothing reserved, evicted or written.
        pages_by_group: dict[int, tuple[list[bytes], int]] = {}
        for gid, hashes in wanted.items():
            store = self.stores[gid]
            block_bytes = self._page_bytes(gid)
            pages = store.get_many(hashes, max_payload_bytes=block_bytes)
            usable = _leading_fits(pages, block_bytes)
            if len(usable) < len(hashes):
                refused = [
                    digest
                    for digest, page in zip(hashes, pages, strict=True)
                    if not _fits(page, block_bytes)
                ]
                self.counters.fetch_misses += len(refused)
                if store.last_call_answered:
                    self.counters.misses_remembered += self.misses_by_group[gid].remember(refused)
                return 0
            pages_by_group[gid] = (usable, block_bytes)
        # Held while the others are reserved: every block the hit needs, local or fetched.
        needed = {
            gid: chain[: hit // allocator.rules[gid].block_tokens] for gid, chain in chains.items()
        }
        fetched = 0
        for gid, hashes in wanted.items():
            index_of = {digest: index for index, digest in enumerate(hashes)}
            group_pages, block_bytes = pages_by_group[gid]
            # One reservation per run of consecutive blocks (a reservation is a run).
            for run in _consecutive_runs(hashes, chains[gid]):
                reservation = allocator.reserve_remote_blocks(gid, run, local_hit=needed)
                if reservation is None:
                    return fetched
                run_pages = [group_pages[index_of[digest]] for digest in run]
                written = self._write(reservation, run_pages, block_bytes)
                fetched += written
                if written < len(run):
                    return fetched
        return fetched

    def _write(self, reservation: RemoteReservation, pages: list[bytes], block_bytes: int) -> int:
        """Run the reservation's demotions, then write the fetched pages (each checked to be
        ``block_bytes`` long, the slots' size) into its slots and confirm them (see
        ``tier_remote.py`` for why in this order); returns the blocks cached (0 when the
        write failed: the slots are freed uncached)."""
        allocator = self.allocator
        transfer = reservation.transfer
        try:
            if reservation.demotions:
                # They read the very slots the pages go to: run and complete them first
                # (a failed one loses its block from the tiers, nothing else).
                self.runner.run_and_complete(allocator, list(reservation.demotions))
            rows = torch.frombuffer(
                bytearray(b"".join(pages[i] for i in transfer.source_blocks)),
                dtype=torch.uint8,
            ).reshape(transfer.num_blocks, block_bytes)
            self.runner.write_blocks(
                transfer.destination_tier, transfer.pool, transfer.destination_blocks, rows
            )
        except (OSError, RuntimeError, IndexError, AllocatorError):
            allocator.complete_transfers([transfer.transfer_id], ok=False)
            self.counters.write_failures += 1
            return 0
        except BaseException:
            allocator.complete_transfers([transfer.transfer_id], ok=False)
            raise
        allocator.complete_transfers([transfer.transfer_id], ok=True)
        self.counters.fetched += transfer.num_blocks
        self.counters.demoted += sum(demotion.num_blocks for demotion in reservation.demotions)
        return transfer.num_blocks


def _fits(page: bytes | None, block_bytes: int) -> bool:
    """Whether a fetched ``page`` is there and ``block_bytes`` long (the only size a slot
    takes)."""
    return page is not None and len(page) == block_bytes


def _leading_fits(pages: list[bytes | None], block_bytes: int) -> list[bytes]:
    """The pages before the first that does not :func:`_fits`."""
    fits: list[bytes] = []
    for page in pages:
        if page is None or not _fits(page, block_bytes):
            break
        fits.append(page)
    return fits


def _consecutive_runs(hashes: list[bytes], chain: Sequence[bytes]) -> list[list[bytes]]:
    """``hashes`` (in chain order) split where they skip a block of ``chain``."""
    position = {digest: index for index, digest in enumerate(chain)}
    runs: list[list[bytes]] = []
    previous = -2
    for digest in hashes:
        index = position[digest]
        if index != previous + 1 or not runs:
            runs.append([])
        runs[-1].append(digest)
        previous = index
    return runs
