"""The engine's offload tiers: where each tier's blocks lie, and running a step's copies.

A plan made with ``host_offload_bytes`` (and ``disk_offload_bytes`` / ``disk_path``) has
tiers below the device; ``materialize()`` gives each tier the device views' per-block
shapes (host memory; the disk tier's files memory-mapped), so a block moves between tiers
as the same pages. The allocator (``offload_tiers=tiers_from_plan(plan)``) records the
copies; :class:`StepTransfers` runs them with the runtime's ``TransferRunner`` over those
views, before the step's forward, and confirms or fails each.

Groups sharing a pool overlay their layers slot by slot (``plan.aliased_layers``), so one
layer per slot covers every page of a block: copying the others too would copy the same
bytes twice.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.views import KVCacheBuffers
from kvspec_core.runtime import KVCacheAllocator
from kvspec_core.runtime.remote_tier import RemoteTier
from kvspec_core.runtime.tier_copy import TransferRunner
from kvspec_core.runtime.tiers import DEVICE_TIER

#: Per tier number (``0`` the device), per pool: the views a block's pages lie in.
TierStorage = dict[int, dict[int, list[torch.Tensor]]]


def pool_layers(plan: KVCachePlan) -> dict[int, list[str]]:
    """Per pool, one layer per page slot (the group with the most layers first), in a
    fixed order: the layers whose views hold every byte of a block of that pool."""
    chosen: dict[int, list[str]] = {}
    covered: set[str] = set()
    for group in sorted(plan.groups, key=lambda group: (-len(group.layers), group.id)):
        for layer in group.layers:
            if layer in covered:
                continue
            chosen.setdefault(group.pool, []).append(layer)
            covered.add(layer)
            covered.update(plan.aliased_layers(layer))
    return chosen


def tier_storage(buffers: KVCacheBuffers) -> TierStorage:
    """The device views and each offload tier's (numbered as the allocator numbers them:
    the plan's tiers in order, from 1), per pool; pools a tier does not hold are absent."""
    layers = pool_layers(buffers.plan)
    storage: TierStorage = {
        DEVICE_TIER: {
            pool: [buffers.views[layer] for layer in names] for pool, names in layers.items()
        }
    }
    for number, tier in enumerate(buffers.plan.tiers, start=1):
        views = buffers.tiers[tier.name].views
        storage[number] = {
            pool: [views[layer] for layer in names]
            for pool, names in layers.items()
            if all(layer in views for layer in names)
        }
    return storage


class StepTransfers:
    """Runs the copies an allocator recorded for a step, before the step's forward.

    ``runner`` is the :class:`TransferRunner` over the tiers' views (replaceable, e.g. by
    one over other storage); ``failed`` counts the transfers that failed so far."""

    def __init__(
        self, allocator: KVCacheAllocator, storage: Mapping[int, Mapping[int, list[torch.Tensor]]]
    ):
        self.allocator = allocator
        self.runner = TransferRunner(storage)
        self.completed = 0
        self.failed = 0
        #: The remote tier the blocks written back from the device are published to
        #: (:mod:`kvspec_transformers.remote`), if any.
        self.remote: RemoteTier | None = None

    def run(self) -> tuple[str | int, ...]:
        """Take the allocator's transfers, run them in order, confirm those that ran and
        fail the rest. Returns the requests a failed load was admitted for: the allocator
        has discarded and freed them (nothing of theirs stays a hit), so they must not run
        this step's forward; admit them again. If running is interrupted (any exception),
        every transfer taken is failed before the error propagates, so none stays
        pending (holding its blocks) forever."""
        transfers = self.allocator.take_transfers()
        if not transfers:
            return ()
        try:
            done, failed, dropped = self.runner.run_and_complete(self.allocator, transfers)
        except BaseException:
            self.failed += len(transfers)  # run_and_complete failed every one of them
            raise
        self.completed += len(done)
        self.failed += len(failed)
        if self.remote is not None:
            self.remote.publish_completed(transfers, done)
        return dropped

    def abandon(self) -> None:
        """Fail the transfers recorded but not run (a step interrupted between its
        ``allocate_slots`` and :meth:`run`): their blocks are released, none stays pending."""
        transfers = self.allocator.take_transfers()
        if transfers:
            self.failed += len(transfers)
            self.allocator.complete_transfers([t.transfer_id for t in transfers], ok=False)
