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
  are read back from that tier and put to the store under the block's hash. Once the
  transfers are completed, the requests to drop always come back: a failed publishing is
  counted, never raised (storage the tier refuses is refused before anything is taken).
* **Fetching.** ``fetch`` asks the store how many of the request's blocks after its local
  hit it has, gets them (a miss, a corrupt value or a page of another size than the tier's
  blocks ends the run there, before any slot is reserved: never a partial block), reserves
  slots for them in the first local tier (host memory;
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
  caching group, each of its own namespace, all built on one ``RemoteServer`` (one
  breaker and one connection pool: a server that is down costs ``failures_to_open`` failed
  calls in all, not per group; ``remote_server.py``). ``fetch`` asks each store which of its group's
  blocks around the local hit it has, and ``KVCacheAllocator.plan_remote_fetch`` lets the
  hybrid coordinator find the hit every group could resume from with those blocks added:
  only the remote blocks that hit needs are fetched (a sliding window: its window's; a
  Mamba group: the one state saved at the hit); every group's pages are checked before
  any slot is reserved, and a missing or refused one ends the fetch with nothing written.

Replicas share blocks only if they hash alike: give every replica's allocator the same
``hash_salt`` (and the same model, layout and block size; the store's namespace keeps
other models apart). Groups of other families are refused (see ``_refusal``), and so are
a store of another hash size and a runner without storage for a group's pool on the
device or in the tier its fetched blocks land in (``_fetch_tiers``).

Its jobs live in ``remote_fetching.py`` and ``remote_publishing.py``; its attributes and
counters in ``remote_tier_state.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.hashing import DIGEST_SIZE
from kvspec_core.runtime.remote_fetching import RemoteFetching
from kvspec_core.runtime.remote_misses import (
    DEFAULT_MISS_CAPACITY,
    DEFAULT_MISS_TTL_S,
    RecentMisses,
)
from kvspec_core.runtime.remote_publishing import RemotePublishing
from kvspec_core.runtime.remote_store import RemoteBlockStore
from kvspec_core.runtime.remote_tier_state import RemoteTierCounters
from kvspec_core.runtime.rules import (
    FullAttentionRules,
    StateCheckpointRules,
    TrailingWindowRules,
)
from kvspec_core.runtime.tier_copy import TransferRunner

if TYPE_CHECKING:
    from kvspec_core.runtime.allocator import KVCacheAllocator

__all__ = ["DEFAULT_MAX_FETCH_BLOCKS", "RemoteTier", "RemoteTierCounters"]

#: Blocks one ``fetch`` asks the store for at most (a bound on one call's wait and bytes).
DEFAULT_MAX_FETCH_BLOCKS = 256


class RemoteTier(RemoteFetching, RemotePublishing):
    """The shared remote store of ``allocator``'s groups, written and read through
    ``runner``'s storage of the local tiers (see the module docstring).

    Args:
        allocator: an allocator with offload tiers and prefix caching whose caching groups
            are full attention, sliding window or Mamba (others are refused with
            :class:`AllocatorError`).
        runner: the engine's transfer runner over the device and tier storage.
        store: the store of the one caching group's blocks, or per caching group (a
            hybrid) its own store, each of its own namespace (which names the model,
            layout, group, pool and rank: see ``BlockNamespace``), all built on one
            ``RemoteServer`` so that they learn the server's health once.
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
        _check_hash_sizes(self.stores)
        if (
            isinstance(max_fetch_blocks, bool)
            or not isinstance(max_fetch_blocks, int)
            or max_fetch_blocks < 1
        ):
            raise AllocatorError(
                f"RemoteTier: max_fetch_blocks={max_fetch_blocks!r} must be an int >= 1"
            )
        self._fetch_tiers = _fetch_tiers(allocator, runner, list(self.stores))
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
        # The plan-based namespace does not see how the runner's views order a block's
        # bytes (kernel-block views do otherwise): keys name that order too.
        self._bind_block_layouts()
        # One full-attention group resumes from a run of leading blocks: fetch the run after
        # the local hit. Any other group (a window, a state), alone or not, is planned.
        self._planned = (
            len(self.stores) > 1 or type(allocator.rules[self.group]) is not FullAttentionRules
        )


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


def _check_hash_sizes(stores: Mapping[int, RemoteBlockStore]) -> None:
    """Every store takes the allocator's block hashes (a store of another hash size would
    refuse each one at the first fetch, inside the engine's step)."""
    for gid, group_store in stores.items():
        size = group_store.config.hash_size
        if size != DIGEST_SIZE:
            raise AllocatorError(
                f"RemoteTier: store[{gid}] has RemoteStoreConfig.hash_size={size}, but the "
                f"allocator's block hashes are {DIGEST_SIZE} bytes; leave hash_size at its "
                f"default ({DIGEST_SIZE})"
            )


def _fetch_tiers(
    allocator: KVCacheAllocator, runner: TransferRunner, groups: list[int]
) -> dict[int, int]:
    """Per group, the tier its fetched blocks land in (the first with slots for its pool,
    where ``reserve_remote_blocks`` reserves them), checked: the runner must hold the
    pool's storage there and on the device (what publishing reads is written from it), or
    every fetch would evict that tier's entries for a write that cannot succeed."""
    runner.prepare(allocator)
    counts = allocator.block_counts()
    tiers: dict[int, int] = {}
    for gid in groups:
        pool = allocator._pool_of[gid]
        tier = min((t for t, p in counts if t >= 1 and p == pool), default=None)
        if tier is None:
            raise AllocatorError(
                f"RemoteTier: no offload tier has slots for pool {pool} (group {gid}'s); "
                "fetched blocks land in the first tier with slots for the pool: give one "
                f"num_blocks > 0 for pool {pool}"
            )
        for needed in (0, tier):
            try:
                runner.block_bytes(needed, pool)
            except AllocatorError:
                raise AllocatorError(
                    f"RemoteTier: the runner has no storage for tier {needed} "
                    f"({allocator.tier_names[needed]!r}), pool {pool} (group {gid}'s); "
                    f"give TransferRunner storage[{needed}][{pool}]: the tier fetches into "
                    "and publishes from it"
                ) from None
        tiers[gid] = tier
    return tiers
