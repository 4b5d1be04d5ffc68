"""What every part of :class:`~kvspec_core.runtime.offloading.TierManager` reads: the
transfer in flight (:class:`PendingTransfer`) and the attributes ``TierManager.__init__``
sets. The manager is assembled from one base class per job (recording copies in
``tier_storing.py``, write-through and the families' keep rules in ``tier_keeping.py``,
lookups across tiers in ``tier_lookup.py``, the engine's side in ``offloading.py``), as
the allocator is (see ``base.py``)."""

from __future__ import annotations

from typing import Any

from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.rules import HitScan
from kvspec_core.runtime.tier_view import TieredView
from kvspec_core.runtime.tiers import OffloadTier, Transfer


class PendingTransfer:
    """One transfer in flight (the mutable twin of the :class:`Transfer` handed out)."""

    __slots__ = (
        "destination",
        "destination_tier",
        "dropped",
        "first_position",
        "generation",
        "group",
        "hashes",
        "held",
        "hit_end",
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
        # A load's request's hit (tokens): its blocks from there on are its own forward's,
        # cached at its admission, written only if that forward runs.
        self.hit_end = 0
        self.taken = False
        # Hashes whose content turned out never written (discard_uncomputed after the copy
        # was recorded): confirmed, the copy caches the others only.
        self.dropped: set[bytes] | None = None
        # The device blocks a write-through copy reads, referenced until it completes: the
        # device cannot evict one meanwhile (its eviction would skip the store, the hash
        # being in flight, and a failed copy would then lose it).
        self.held: list[int] | None = None

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


class TierState:
    """The layout of a :class:`~kvspec_core.runtime.offloading.TierManager` (see its
    ``__init__`` for what each attribute holds)."""

    tiers: tuple[OffloadTier, ...]
    device_pools: list[BlockPool]
    pool_of_group: list[int]
    _victims: list[list[tuple[list[int], list[bytes], list[int]]]]
    tier_pools: list[list[BlockPool | None]]
    views: list[TieredView]
    scans: list[HitScan]
    _storing: list[dict[int, dict[bytes, int]]]
    _pending: dict[int, PendingTransfer]
    _handed: dict[str | int, tuple[object, ...]]
    _queue: list[PendingTransfer]
    _next_id: int
    generation: int
    blocks_moved: dict[tuple[int, int], int]
    # write-through and the families' keep rules (tier_keeping.py)
    _through: list[bool]
    _through_marks: dict[str | int, tuple[object, list[int]]]
    _through_ready: list[tuple[str | int, Any, int, int, list[int], list[bytes]]]
    _through_from: list[dict[int, bytes]]
    _keep_rules: dict[int, object]
    _kept: list[dict[int, bytes]]
