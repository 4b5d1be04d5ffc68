"""What a :class:`~kvspec_core.runtime.remote_tier.RemoteTier` holds, read by each of its jobs
(``remote_fetching.py``, ``remote_publishing.py``), and its counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.remote_misses import RecentMisses
from kvspec_core.runtime.remote_store import RemoteBlockStore
from kvspec_core.runtime.tier_copy import TransferRunner

if TYPE_CHECKING:
    from kvspec_core.runtime.allocator import KVCacheAllocator


@attrs.define
class RemoteTierCounters:
    """What the remote tier did (the store's own counters say what the server answered).
    ``RemoteTier.counters`` is this object, updated in place as the tier works (unlike
    ``RemoteBlockStore.counters``, a snapshot): take ``attrs.evolve(tier.counters)`` to
    compare before and after."""

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


class RemoteTierState:
    """The attributes ``RemoteTier.__init__`` sets (see its docstring)."""

    allocator: KVCacheAllocator
    runner: TransferRunner
    #: Per caching group, its store (each of its own namespace; a hybrid's share a server).
    stores: dict[int, RemoteBlockStore]
    #: The first caching group and its store (the only ones without a hybrid).
    group: int
    store: RemoteBlockStore
    max_fetch_blocks: int
    #: Per group, hashes its store recently answered it did not have (``remote_misses.py``).
    misses_by_group: dict[int, RecentMisses]
    misses: RecentMisses
    counters: RemoteTierCounters
    #: Per caching group, the tier its fetched blocks land in: the first with slots for its
    #: pool (``tier_remote.py``), where the runner has storage for it.
    _fetch_tiers: dict[int, int]
    #: Whether fetches are planned over the groups (a hybrid, or one group that is not full
    #: attention) rather than a run of leading blocks.
    _planned: bool

    def _bind_block_layouts(self) -> None:
        """Bind each store's keys to the order the runner's storage gives its group's block
        bytes (``RemoteBlockStore.bind_block_layout``): at construction, then before each
        fetch and publish, so that storage replaced since is refused, not read under keys
        of another order."""
        self.runner.prepare(self.allocator)
        for gid, store in self.stores.items():
            layout = self.runner.source_block_layout(self.allocator._pool_of[gid])
            try:
                store.bind_block_layout(layout)
            except ValueError as error:  # bound to another layout
                raise AllocatorError(
                    f"RemoteTier: group {gid}'s storage orders a block's bytes otherwise than "
                    f"when its store was bound ({error}); build a RemoteTier, with its own "
                    "stores, for the new storage"
                ) from None
