"""Freeing: ``free``, ``discard_uncomputed`` (free a request whose forward failed, uncaching
the blocks it never wrote) and ``reset_prefix_cache``."""

from __future__ import annotations

from typing import Any

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.base import AllocatorBase
from kvspec_core.runtime.events import AllBlocksCleared
from kvspec_core.runtime.running import _Running
from kvspec_core.runtime.tier_keeping import TierKeeping

#: Request ids remembered after ``free`` so a second ``free`` says "already freed".
_FREED_MEMORY = 4096


class Freeing(AllocatorBase):
    """Releasing requests and the prefix cache (part of ``KVCacheAllocator``)."""

    def free(self, request_id: str | int) -> None:
        """Release every block of a request; blocks holding cached prefixes stay findable
        until evicted (its last blocks are evicted first). With offload tiers, a group
        whose rules say which blocks are worth keeping below the device (``offload_range``)
        marks those now. Refuses unknown ids, double frees and a keep rule's bad answer
        with :class:`AllocatorError`, changing nothing."""
        state = self._state(request_id)
        self._release(request_id, state, self._keep_marks(state))

    def _keep_marks(self, state: _Running) -> list[Any] | None:
        """What the keep rules mark when ``state`` is freed (see ``TierKeeping``), asked
        before anything changes; None without keep rules."""
        tiers = self._tiers
        if tiers is None or not tiers._keep_rules:
            return None
        return tiers.keep_marks(state)

    def _release(self, request_id: str | int, state: _Running, marks: list[Any] | None) -> None:
        """Free ``state``, setting the keep ``marks`` (from :meth:`_keep_marks`) first."""
        if marks:
            TierKeeping.mark_kept(marks)
        # A running request's tables hold each block once, with a reference of its own
        # (check_invariants), so the pools' release checks cannot fire here. Each table is
        # released last block first, groups in order: the order one list per pool gives.
        group_pools = self._group_pools
        for gid, table in enumerate(state.blocks):
            group_pools[gid]._release_unchecked(table, reverse=True)
        del self._running[request_id]
        self._freed[request_id] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)

    def discard_uncomputed(
        self, request_id: str | int, num_valid_tokens: int
    ) -> dict[str | int, int]:
        """Free a request whose computation stopped early (an engine's forward raised, or was
        interrupted), leaving no false hit behind.

        ``allocate_slots`` caches a block as soon as its tokens are known, before the engine
        writes its K/V (or saves its state). Here every block of the request that covers a
        position ``>= num_valid_tokens`` (the tokens whose cache content the engine did
        write) first leaves the prefix cache, so no later lookup can hit it; then the
        request is freed as by :meth:`free` (the blocks before stay cached). Works the same
        with the compiled kernels and in pure Python (it changes the pools' Python-side
        maps, which both read).

        Returns the other running requests that reused such a block (admitted in the same
        step, they hit a block this request was to compute), each with the tokens before
        the first one: what they read from there on was never written. They keep their
        blocks, uncached; discard each the same way (its call returns its own) unless the
        engine discards it anyway. (A request's prefix hit counts as written: a count below
        it uncaches blocks other requests computed, and reports their holders too.)

        Refuses unknown ids, double frees and a count that is not an int in ``[0,
        num_computed_tokens]``, and a keep rule's bad answer (``offload_range``), with
        :class:`AllocatorError`, changing nothing.
        """
        state = self._state(request_id)
        if num_valid_tokens.__class__ is not int or not 0 <= num_valid_tokens <= state.computed:
            raise AllocatorError(
                f"discard_uncomputed(request {request_id!r}): num_valid_tokens="
                f"{num_valid_tokens!r} must be an int in [0, {state.computed}]: the tokens "
                "whose K/V or state the engine wrote before it stopped"
            )
        uncached = self._discard(request_id, state, num_valid_tokens, self._keep_marks(state))
        return self._reusers(uncached)

    def _reusers(self, blocks: dict[int, set[int]]) -> dict[str | int, int]:
        """The running requests holding any of ``blocks`` (per group), each with the token
        position where the first of them starts in its table."""
        found: dict[str | int, int] = {}
        for request_id, state in self._running.items():
            for gid, group_blocks in blocks.items():
                table = state.blocks[gid]
                if group_blocks.isdisjoint(table):
                    continue
                first = next(index for index, block in enumerate(table) if block in group_blocks)
                position = first * self._block_tokens[gid]
                if position < found.get(request_id, position + 1):
                    found[request_id] = position
        return found

    def _discard(
        self,
        request_id: str | int,
        state: _Running,
        num_valid_tokens: int,
        marks: list[Any] | None,
    ) -> dict[int, set[int]]:
        """:meth:`discard_uncomputed` once checked, with the keep ``marks`` asked already:
        nothing here can be refused. Returns the blocks it uncached, per group."""
        from kvspec_core.runtime.events import BlockRemoved

        uncached: dict[int, set[int]] = {}
        for gid in self._holding:
            pool = self._group_pools[gid]
            cache = self._caches[gid]
            block_hash = pool._block_hash
            removed: list[bytes] = []
            removed_blocks: list[int] = []
            # Block i is cached under the hash of tokens [0, (i + 1) * block): it claims
            # content past num_valid_tokens from index num_valid_tokens // block on.
            for block in state.blocks[gid][num_valid_tokens // self._block_tokens[gid] :]:
                digest = block_hash[block] if block else None
                if digest is not None:
                    cache.pop(digest, None)
                    block_hash[block] = None
                    pool._reused[block] = 0
                    removed.append(digest)
                    removed_blocks.append(block)
            if removed:
                uncached[gid] = set(removed_blocks)
                # A prefix found before may name these blocks: admissions check it again.
                pool.epoch += 1
                if self._events is not None:
                    self._events.append(BlockRemoved(group=gid, block_hashes=tuple(removed)))
                if self._tiers is not None:
                    self._tiers.forget_unwritten(gid, removed, removed_blocks)
        if self._tiers is not None:
            self._tiers.forget_notes(
                state,
                {
                    gid: state.blocks[gid][num_valid_tokens // self._block_tokens[gid] :]
                    for gid in self._holding
                },
            )
        self._release(request_id, state, marks)
        return uncached

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in every offload tier too (running requests keep
        their blocks, uncached; transfers in flight complete without caching anything)."""
        for pool in self.pools:
            pool.reset_prefix_cache(record_event=False)
        if self._tiers is not None:
            self._tiers.reset()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
