"""Publishing: a :class:`~kvspec_core.runtime.remote_tier.RemoteTier`'s job of putting the
pages of the blocks the step's transfers wrote from the device into a tier to the shared
store (see ``remote_tier.py``'s module docstring, *Publishing*)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.remote_tier_state import RemoteTierState
from kvspec_core.runtime.tiers import DEVICE_TIER, STORE, Transfer


class RemotePublishing(RemoteTierState):
    """:meth:`run_pending` and the publishing of completed device -> tier stores."""

    def run_pending(self) -> tuple[str | int, ...]:
        """``TransferRunner.run_pending`` (take, run in order, complete; returns the
        requests to drop from the step), then publish the blocks the step's completed
        stores wrote from the device into a tier. Call it before the step's forward.

        Storage replaced since the tier was built raises :class:`AllocatorError` before
        anything is taken (the transfers stay pending). Once they are completed, the
        requests to drop are always returned: a publishing that fails is counted in
        ``publish_failures``, never raised."""
        self._bind_block_layouts()
        taken = self.allocator.take_transfers()
        done, _, dropped = self.runner.run_and_complete(self.allocator, taken)
        stores = self._completed_stores(taken, done)
        counters = self.counters
        counted = counters.published + counters.publish_failures
        try:
            self.publish(stores)
        except Exception as error:
            # The completed transfers freed the dropped requests' blocks: losing the list
            # would run their forward on them. A block not published is only a remote miss;
            # the error is told as a warning, not lost.
            left = sum(t.num_blocks for t in stores) - (
                counters.published + counters.publish_failures - counted
            )
            counters.publish_failures += max(0, left)
            warnings.warn(
                f"RemoteTier.run_pending: publishing the step's blocks failed ({error!r}); "
                f"{max(0, left)} blocks counted in publish_failures",
                RuntimeWarning,
                stacklevel=2,
            )
        return dropped

    def publish_completed(self, taken: Sequence[Transfer], done: Sequence[int]) -> int:
        """:meth:`publish` the stores from the device among ``taken`` (a step's transfers)
        whose ids are in ``done`` (those that ran and were confirmed): for an engine that
        runs its transfers itself. Returns how many blocks the servers took."""
        return self.publish(self._completed_stores(taken, done))

    def _completed_stores(self, taken: Sequence[Transfer], done: Sequence[int]) -> list[Transfer]:
        """The stores from the device among ``taken`` whose ids are in ``done``, of the groups
        with a store."""
        ran = set(done)
        return [
            transfer
            for transfer in taken
            if transfer.transfer_id in ran
            and transfer.kind == STORE
            and transfer.source_tier == DEVICE_TIER
            and transfer.group in self.stores
        ]

    def publish(self, stores: list[Transfer]) -> int:
        """Put the pages of completed device -> tier stores to their group's store under
        their blocks' hashes (read back from the tier); returns how many the servers took.
        Groups without a store are skipped, and so are blocks the tier does not cache under
        that hash in that slot (``KVCacheAllocator.tier_holds``: a copy dropped as never
        computed, a slot evicted since)."""
        if not stores:
            return 0  # (most steps): no key is computed, no layout need be checked
        self._bind_block_layouts()
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
