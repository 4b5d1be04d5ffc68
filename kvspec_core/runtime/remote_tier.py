"""A remote store shared by replicas, as the tier below an allocator's local ones.

The allocator never touches the network: :class:`RemoteTier` sits beside the engine's
:class:`~kvspec_core.runtime.tier_copy.TransferRunner` and does the remote I/O::

    remote = RemoteTier(allocator, runner, store)   # store: a RemoteBlockStore
    remote.fetch(request)                           # before the lookup: remote hits -> a tier
    prefix = allocator.find_cached_prefix(request)  # finds them as tier hits (loads)
    allocator.allocate_slots(request, n, prefix=prefix)
    dropped = remote.run_pending()                  # runner.run_pending + publishing

* **Publishing.** ``run_pending`` runs the step's transfers as ``TransferRunner.run_pending``
  does; then the pages of each device block stored into a tier (an eviction's write-back)
  are read back from that tier and put to the store under the block's hash.
* **Fetching.** ``fetch`` asks the store how many of the request's blocks after its local
  hit it has, gets them (a miss or a corrupt value ends the run there: never a partial
  block), reserves slots for them in the first local tier (host memory;
  ``KVCacheAllocator.reserve_remote_blocks``: pending, never a hit until written), runs the
  demotions of the entries those slots evicted to the tier below, writes the pages and
  confirms: they are then tier entries, cached under the very hashes they were fetched by,
  that the next ``find_cached_prefix`` loads like any tier hit. A failed write frees the
  slots uncached.
* **Failures.** A server that is down, slow or trickling costs misses within each store
  call's deadline (which grows with the call's bytes; the store counts them; see
  ``remote_store.py``); nothing raises into the step. Both directions run in the caller's
  step. Call ``fetch`` once per admission: after a load of a fetched block failed, fetching
  again would bring that block back (the engine would retry the same load).
* **Recent misses.** A hash the server answered it had no valid value for is remembered
  for ``miss_ttl_s`` (1 s; at most ``miss_capacity``, 4,096): fetches meanwhile end their
  run before it without asking. Failed calls are never remembered, entries expire (a block
  another replica publishes later is found after the expiry), and publishing a hash
  forgets it (``remote_misses.py``).

* **Hybrids** (full attention with sliding window and/or Mamba groups). One store per
  caching group, each of its own namespace. ``fetch`` asks each store which of its group's
  blocks around the local hit it has, and ``KVCacheAllocator.plan_remote_fetch`` lets the
  hybrid coordinator find the hit every group could resume from with those blocks added:
  only the remote blocks that hit needs are fetched (a sliding window: its window's; a
  Mamba group: the one state saved at the hit), all or nothing.

Replicas share blocks only if they hash alike: give every replica's allocator the same
``hash_salt`` (and the same model, layout and block size; the store's namespace keeps
other models apart). Groups of other families are refused (see ``_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.remote_misses import (
    DEFAULT_MISS_CAPACITY,
    DEFAULT_MISS_TTL_S,
    RecentMisses,
)
from kvspec_core.runtime.remote_store import RemoteBlockStore
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.rules import (
    FullAttentionRules,
    StateCheckpointRules,
    TrailingWindowRules,
)
from kvspec_core.runtime.tier_copy import TransferRunner
from kvspec_core.runtime.tier_remote import RemoteReservation
from kvspec_core.runtime.tiers import DEVICE_TIER, STORE, Transfer

if TYPE_CHECKING:
    from kvspec_core.runtime.allocator import KVCacheAllocator

#: Blocks one ``fetch`` asks the store for at most (a bound on one call's wait and bytes).
DEFAULT_MAX_FETCH_BLOCKS = 256


@attrs.define
class RemoteTierCounters:
    """What the remote tier did (the store's own counters say what the server answered)."""

    #: Blocks fetched and cached in a local tier.
    fetched: int = 0
    #: Blocks the store said it had but did not return (absent by now, corrupt, failed)
    #: or returned with a size other than the local tier's block size.
    fetch_misses: int = 0
    #: Blocks the server took from :meth:`RemoteTier.run_pending`'s publishing.
    published: int = 0
    #: Blocks not published: the server refused them or was down, or the tier's copy
    #: could not be read back.
    publish_failures: int = 0
    #: Fetched runs whose write into the local tier failed (their slots freed uncached).
    write_failures: int = 0
    #: Tier entries the fetched blocks' slots evicted, copied to the tier below first.
    demoted: int = 0
    #: Hashes remembered as missed (the server answered it had no valid value for them, or
    #: one of another size than the local tier's blocks).
    misses_remembered: int = 0
    #: Fetches whose run ended at a remembered miss (so the server was asked about fewer
    #: blocks: see ``remote_misses.py``).
    remembered_miss_hits: int = 0
    #: Of those, fetches that did not ask the server at all.
    fetches_not_asked: int = 0


class RemoteTier:
    """The shared remote store of ``allocator``'s groups, written and read through
    ``runner``'s storage of the local tiers (see the module docstring).

    Args:
        allocator: an allocator with offload tiers and prefix caching whose caching groups
            are full attention, sliding window or Mamba (others are refused with
            :class:`AllocatorError`).
        runner: the engine's transfer runner over the device and tier storage.
        store: the store of the one caching group's blocks, or per caching group (a
            hybrid) its own store, each of its own namespace (which names the model,
            layout, group, pool and rank: see ``BlockNamespace``).
        max_fetch_blocks: blocks one :meth:`fetch` asks for at most (per group).
        miss_ttl_s / miss_capacity: how long a miss is remembered, and how many at most
            (:class:`~kvspec_core.runtime.remote_misses.RecentMisses`; 0 remembers none).
        clock: the misses' clock (seconds, monotonic); tests pass their own.
    """

    def __init__(
        self,
        allocator: KVCacheAllocator,
        runner: TransferRunner,
        store: RemoteBlockStore | Mapping[int, RemoteBlockStore],
        *,
        max_fetch_blocks: int = DEFAULT_MAX_FETCH_BLOCKS,
        miss_ttl_s: float = DEFAULT_MISS_TTL_S,
        miss_capacity: int = DEFAULT_MISS_CAPACITY,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(runner, TransferRunner):
            raise AllocatorError(
                f"RemoteTier: runner must be a TransferRunner, not {type(runner).__name__}"
            )
        if len(allocator.tier_names) < 2:
            raise AllocatorError(
                "RemoteTier: the allocator has no offload tiers; remote blocks are loaded "
                "through a local one (offload_tiers=(OffloadTier('host', n),))"
            )
        holding = [gid for gid, cap in enumerate(allocator.admission_caps) if cap > 0]
        if not allocator.enable_prefix_caching or not holding:
            raise AllocatorError(
                "RemoteTier: needs prefix caching and a KV-cache group that caches blocks"
            )
        for gid in holding:
            refusal = _refusal(allocator.rules[gid])
            if refusal is not None:
                raise AllocatorError(
                    f"RemoteTier: group {gid} ({allocator.specs[gid].kind}) {refusal}"
                )
        self.stores = _stores_by_group(store, holding)
        if (
            isinstance(max_fetch_blocks, bool)
            or not isinstance(max_fetch_blocks, int)
            or max_fetch_blocks < 1
        ):
            raise AllocatorError(
                f"RemoteTier: max_fetch_blocks={max_fetch_blocks!r} must be an int >= 1"
            )
        self.allocator = allocator
        self.runner = runner
        #: The first caching group and its store (the only ones without a hybrid).
        self.group = holding[0]
        self.store = self.stores[self.group]
        self.max_fetch_blocks = max_fetch_blocks
        #: Per group, hashes its store recently answered it did not have
        #: (``remote_misses.py``).
        self.misses_by_group = {
            gid: RecentMisses(miss_ttl_s, miss_capacity, clock) for gid in self.stores
        }
        self.misses = self.misses_by_group[self.group]
        self.counters = RemoteTierCounters()
        # One full-attention group resumes from a run of leading blocks: fetch the run after
        # the local hit. Any other group (a window, a state), alone or not, is planned.
        self._planned = (
            len(self.stores) > 1 or type(allocator.rules[self.group]) is not FullAttentionRules
        )

    # ----------------------------------------------------------------- fetching
    def fetch(self, request: Request) -> int:
        """Bring the request's blocks after its local hit from the store into a local tier,
        before ``find_cached_prefix``; returns how many now lie there (0 on any miss, a
        server down or slow, a running request, nothing to fetch)."""
        allocator = self.allocator
        if allocator.is_running(request.request_id):
            return 0
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
        pages = store.get_many(wanted[:run])
        good = next((i for i, page in enumerate(pages) if page is None), run)
        self.counters.fetch_misses += run - good
        if good < run and store.last_call_answered:
            self._remember_miss(wanted[good])  # gone since, or a corrupt value
        if good == 0:
            return 0
        reservation = allocator.reserve_remote_blocks(
            self.group, wanted[:good], local_hit=hashes[:start]
        )
        if reservation is None:
            return 0
        return self._write(reservation, pages)

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
                self.counters.remembered_miss_hits += 1
                asked = [digest for digest in asked if not misses.remembers(digest)]
            if not asked:
                continue
            store = self.stores[gid]
            present = store.contains_many(asked)
            if store.last_call_answered:
                absent = [digest for digest, has in zip(asked, present, strict=True) if not has]
                self.counters.misses_remembered += misses.remember(absent)
            available[gid] = {digest for digest, has in zip(asked, present, strict=True) if has}
        if not available:
            self.counters.fetches_not_asked += remembered_any
            return 0
        hit, wanted = allocator.plan_remote_fetch(request, available)
        if hit <= local or not wanted:
            return 0
        pages_by_group: dict[int, list[bytes | None]] = {}
        for gid, hashes in wanted.items():
            store = self.stores[gid]
            pages = store.get_many(hashes)
            missing = [digest for digest, page in zip(hashes, pages, strict=True) if page is None]
            if missing:
                self.counters.fetch_misses += len(missing)
                if store.last_call_answered:
                    self.counters.misses_remembered += self.misses_by_group[gid].remember(missing)
                return 0
            pages_by_group[gid] = pages
        # Held while the others are reserved: every block the hit needs, local or fetched.
        needed = {
            gid: chain[: hit // allocator.rules[gid].block_tokens] for gid, chain in chains.items()
        }
        fetched = 0
        for gid, hashes in wanted.items():
            index_of = {digest: index for index, digest in enumerate(hashes)}
            group_pages = pages_by_group[gid]
            # One reservation per run of consecutive blocks (a reservation is a run).
            for run in _consecutive_runs(hashes, chains[gid]):
                reservation = allocator.reserve_remote_blocks(gid, run, local_hit=needed)
                if reservation is None:
                    return fetched
                run_pages = [group_pages[index_of[digest]] for digest in run]
                written = self._write(reservation, run_pages)
                fetched += written
                if written < len(run):
                    return fetched
        return fetched

    def _write(self, reservation: RemoteReservation, pages: list[bytes | None]) -> int:
        """Run the reservation's demotions, then write the fetched pages into its slots and
        confirm them (see ``tier_remote.py`` for why in this order); returns the blocks
        cached (0 when the write failed: the slots are freed uncached)."""
        allocator = self.allocator
        transfer = reservation.transfer
        try:
            if reservation.demotions:
                # They read the very slots the pages go to: run and complete them first
                # (a failed one loses its block from the tiers, nothing else).
                self.runner.run_and_complete(allocator, list(reservation.demotions))
            block_bytes = self.runner.block_bytes(transfer.destination_tier, transfer.pool)
            fetched = [pages[i] for i in transfer.source_blocks]
            wrong = [
                digest
                for digest, page in zip(transfer.block_hashes, fetched, strict=True)
                if page is None or len(page) != block_bytes
            ]
            if wrong:
                # Another layout under this namespace: the caller's namespace is wrong. The
                # server answered: remembered like a corrupt value, not asked again at once.
                self.counters.fetch_misses += transfer.num_blocks
                self.counters.misses_remembered += self.misses_by_group[transfer.group].remember(
                    wrong
                )
                allocator.complete_transfers([transfer.transfer_id], ok=False)
                return 0
            rows = torch.frombuffer(
                bytearray(b"".join(fetched)),  # type: ignore[arg-type]
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

    # ----------------------------------------------------------------- publishing
    def run_pending(self) -> tuple[str | int, ...]:
        """``TransferRunner.run_pending`` (take, run in order, complete; returns the
        requests to drop from the step), then publish the blocks the step's completed
        stores wrote from the device into a tier. Call it before the step's forward."""
        taken = self.allocator.take_transfers()
        done, _, dropped = self.runner.run_and_complete(self.allocator, taken)
        self.publish_completed(taken, done)
        return dropped

    def publish_completed(self, taken: Sequence[Transfer], done: Sequence[int]) -> int:
        """:meth:`publish` the stores from the device among ``taken`` (a step's transfers)
        whose ids are in ``done`` (those that ran and were confirmed): for an engine that
        runs its transfers itself. Returns how many blocks the servers took."""
        ran = set(done)
        return self.publish(
            [
                transfer
                for transfer in taken
                if transfer.transfer_id in ran
                and transfer.kind == STORE
                and transfer.source_tier == DEVICE_TIER
                and transfer.group in self.stores
            ]
        )

    def publish(self, stores: list[Transfer]) -> int:
        """Put the pages of completed device -> tier stores to their group's store under
        their blocks' hashes (read back from the tier); returns how many the servers took.
        Groups without a store are skipped, and so are blocks the tier does not cache under
        that hash in that slot (``KVCacheAllocator.tier_holds``: a copy dropped as never
        computed, a slot evicted since)."""
        by_group: dict[int, list[tuple[bytes, bytes]]] = {}
        for transfer in stores:
            if transfer.group not in self.stores:
                continue
            if len(transfer.block_hashes) != transfer.num_blocks:
                raise AllocatorError(
                    f"RemoteTier.publish: transfer {transfer.transfer_id} names "
                    f"{len(transfer.block_hashes)} hashes for {transfer.num_blocks} blocks"
                )
            try:
                rows = self.runner.read_blocks(
                    transfer.destination_tier, transfer.pool, transfer.destination_blocks
                )
            except (OSError, RuntimeError, IndexError, AllocatorError):
                self.counters.publish_failures += transfer.num_blocks
                continue
            data = rows.contiguous().numpy()
            # Only what the tier caches under that hash in that slot: a copy the allocator
            # dropped at completion (never computed) must not become another replica's hit.
            held = self.allocator.tier_holds(transfer)
            by_group.setdefault(transfer.group, []).extend(
                (digest, data[row].tobytes())
                for row, digest in enumerate(transfer.block_hashes)
                if held[row]
            )
        total = 0
        for gid, blocks in by_group.items():
            self.misses_by_group[gid].forget(digest for digest, _ in blocks)
            stored = self.stores[gid].put_many(blocks)
            self.counters.published += stored
            self.counters.publish_failures += len(blocks) - stored
            total += stored
        return total


def _refusal(rules: object) -> str | None:
    """Why the remote tier cannot serve a group of these rules, or None if it can: full
    attention, trailing windows (sliding window) and state checkpoints (Mamba: the state
    saved at the hit position) are served; other families are refused rather than trusted
    untested."""
    if type(rules) is FullAttentionRules or isinstance(
        rules, (TrailingWindowRules, StateCheckpointRules)
    ):
        return None
    return (
        f"has rules {type(rules).__name__}; the remote tier serves full attention, sliding "
        "window (trailing-window rules) and Mamba (state-checkpoint rules) groups only"
    )


def _stores_by_group(
    store: RemoteBlockStore | Mapping[int, RemoteBlockStore], holding: list[int]
) -> dict[int, RemoteBlockStore]:
    """``store`` as one store per caching group, checked."""
    if isinstance(store, RemoteBlockStore):
        if len(holding) != 1:
            raise AllocatorError(
                f"RemoteTier: the allocator has {len(holding)} caching groups {holding}; give "
                "store={group: RemoteBlockStore} with one store per group, each of its own "
                "namespace (the groups' blocks differ, their hashes may not)"
            )
        return {holding[0]: store}
    if not isinstance(store, Mapping):
        raise AllocatorError(
            "RemoteTier: store must be a RemoteBlockStore or a mapping group -> "
            f"RemoteBlockStore, not {type(store).__name__}"
        )
    if sorted(store) != holding:
        raise AllocatorError(
            f"RemoteTier: store names groups {sorted(store)}; give one store for each "
            f"caching group, {holding}"
        )
    for gid, group_store in store.items():
        if not isinstance(group_store, RemoteBlockStore):
            raise AllocatorError(
                f"RemoteTier: store[{gid}] must be a RemoteBlockStore, not "
                f"{type(group_store).__name__}"
            )
    namespaces = [group_store.namespace for group_store in store.values()]
    if len(set(namespaces)) != len(namespaces):
        raise AllocatorError(
            "RemoteTier: two groups' stores share a namespace; give each group its own "
            "(e.g. BlockNamespace.of(..., group=gid)): groups of one block size hash "
            "alike, so one group's pages would be read as another's"
        )
    return {gid: store[gid] for gid in holding}


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
