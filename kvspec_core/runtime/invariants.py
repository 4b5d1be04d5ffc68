"""State checks: ``check_invariants`` cross-checks the pools against the running requests'
block tables and each cached block against the request's own hashes (tests, fuzzers)."""

from __future__ import annotations

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.base import AllocatorBase


class InvariantChecks(AllocatorBase):
    """``check_invariants`` (part of ``KVCacheAllocator``)."""

    def check_invariants(self) -> None:
        """Cross-check pools and block tables; raises :class:`AllocatorError` (tests)."""
        for pool in self.pools:
            pool.check_invariants()
        expected = [dict() for _ in self.pools]  # type: list[dict[int, int]]
        owner = [dict() for _ in self.pools]  # type: list[dict[int, int]]
        for state in self._running.values():
            for gid, table in enumerate(state.blocks):
                counts = expected[self._pool_of[gid]]
                owners = owner[self._pool_of[gid]]
                for block in table:
                    if block:
                        counts[block] = counts.get(block, 0) + 1
                        if owners.setdefault(block, gid) != gid:
                            raise AllocatorError(
                                f"pool {self._pool_of[gid]} block {block} is in the tables "
                                f"of groups {owners[block]} and {gid}"
                            )
        if self._tiers is not None:
            # Loads in flight hold a reference on their destination blocks.
            for counts, held in zip(expected, self._tiers.pending_device_refs(), strict=True):
                for block, times in held.items():
                    counts[block] = counts.get(block, 0) + times
            self._tiers.check_invariants()
        self._check_shared_prefixes()
        for index, pool in enumerate(self.pools):
            for block in range(1, pool.num_blocks):
                if pool.ref_counts[block] != expected[index].get(block, 0):
                    raise AllocatorError(
                        f"pool {index} block {block}: ref count {pool.ref_counts[block]} but "
                        f"{expected[index].get(block, 0)} block-table entries"
                    )

    def _check_shared_prefixes(self) -> None:
        """Each running request's block at position ``i`` of a group holds the prefix of the
        request's first ``(i + 1) * block`` tokens: a cached block is cached under the
        request's hash there, and a block two requests share sits at one position with one
        hash in both (where their hashes are known). Raises :class:`AllocatorError`."""
        seen: dict[tuple[int, int], tuple[int, bytes | None, str | int]] = {}
        for rid, state in self._running.items():
            if state.computed.__class__ is not int or not 0 <= state.computed <= self.max_model_len:
                raise AllocatorError(
                    f"request {rid!r}: {state.computed!r} computed tokens, not in "
                    f"[0, {self.max_model_len}]"
                )
            request = state.request
            fine = request.block_hashes if request._hash_owner is self._hasher else []
            for gid in self._holding:
                stride = self._hash_stride[gid]
                pool_index = self._pool_of[gid]
                block_hash = self._group_pools[gid]._block_hash
                for index, block in enumerate(state.blocks[gid]):
                    if not block:
                        continue
                    position = (index + 1) * stride - 1
                    mine = fine[position] if position < len(fine) else None
                    cached = block_hash[block]
                    if cached is not None and mine is not None and cached != mine:
                        raise AllocatorError(
                            f"request {rid!r} group {gid}: block {block} at position {index} "
                            "is cached under another prefix's hash than the request's"
                        )
                    other = seen.setdefault((pool_index, block), (index, mine, rid))
                    if other[2] != rid and (
                        other[0] != index
                        or (mine is not None and other[1] is not None and other[1] != mine)
                    ):
                        raise AllocatorError(
                            f"pool {pool_index} block {block} is shared by requests "
                            f"{other[2]!r} (position {other[0]}) and {rid!r} (position "
                            f"{index}) whose prefixes (hashes) differ"
                        )
