"""What every step that takes blocks does around them: the preflight (hash, ask the plugin
rules, before anything changes), caching the blocks the step filled (and their
``BlockStored`` events), and the three thresholds that let most decode steps skip the rest.

Shared by admission (``admission.py``) and growth (``growth.py``); methods of the allocator
for the reasons in ``base.py`` (the compiled admission and group step are used only while
``_preflight``, ``_cache_new_blocks`` and ``_update_limits`` are these).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec_core.runtime.base import AllocatorBase
from kvspec_core.runtime.events import BlockStored, KVCacheEvent
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.rules import NEVER
from kvspec_core.runtime.running import _Running


class BlockCaching(AllocatorBase):
    """Preflight, caching of filled blocks, step thresholds (part of ``KVCacheAllocator``)."""

    def _preflight(
        self,
        request: Request,
        known: int,
        lengths: dict[int, int],
        skips: dict[int, int],
        num_cached: Sequence[int],
        cache_at: Sequence[int],
    ) -> None:
        """Do, before a step changes anything, what could fail after it started: hash the
        tokens it caches (bad token ids), and ask the plugin rules what the step will ask
        them afterwards (new table ``lengths`` and ``skips`` per changed group)."""
        available = min(known, len(request.token_ids))
        if self._cacheable:
            self._hasher.hashes(request, available)
        for gid in self._guarded:
            rules = self.rules[gid]
            methods = self._guarded_methods[gid]
            if gid in lengths:
                if "next_allocation_end" in methods:
                    rules.next_allocation_end(lengths[gid])
                if "next_skip_position" in methods:
                    rules.next_skip_position(skips[gid])
            if (
                "cache_range" in methods
                and self._cacheable
                and available >= cache_at[gid]
                and not (self._is_state_group[gid] and known > available)
            ):
                # Exactly what _cache_new_blocks will ask (found by review: a prompt-only
                # group was asked up to its prompt only after the step had moved on).
                rules.cache_range(num_cached[gid], self._cache_limit(gid, request, available))

    def _cache_new_blocks(self, state: _Running, known: int) -> None:
        request = state.request
        available = len(request.token_ids)
        upto = known if known < available else available
        num_cached = state.num_cached
        cache_at = state.cache_at
        for gid in self._holding:
            if upto < cache_at[gid]:
                continue
            tokens = self._block_tokens[gid]
            if self._is_state_group[gid] and known > available:
                # The step ends past the tokens the engine appended (drafts): the state
                # it saves is not the state of a known prefix, so nothing is cached.
                start = stop = known // tokens
            else:
                start, stop = self.rules[gid].cache_range(
                    num_cached[gid], self._cache_limit(gid, request, upto)
                )
            if stop > start:
                stride = self._hash_stride[gid]
                # The step's preflight hashed every full block it knows.
                fine = request.block_hashes
                if len(fine) < stop * stride:
                    fine = self._hasher.hashes(request, stop * tokens)
                digests = fine[(start + 1) * stride - 1 : stop * stride : stride]
                table = state.blocks[gid]
                pool = self._group_pools[gid]
                pool.cache_blocks(gid, digests, table[start:stop])
                if self._events is not None:
                    self._record_stored(self._events, gid, request, fine, table, start, stop)
            if stop > num_cached[gid]:
                num_cached[gid] = stop
            cache_at[gid] = (num_cached[gid] + 1) * tokens

    def _cache_limit(self, gid: int, request: Request, upto: int) -> int:
        """Up to which token group ``gid`` may cache a step's blocks known up to ``upto``:
        past the prompt a prompt-only group's K/V depend on where it ended (R-SWA)."""
        if self._prompt_only[gid] and upto > request.num_prompt_tokens:
            return request.num_prompt_tokens
        return upto

    def _record_loaded(self, gid: int, state: _Running, hashes: list[bytes]) -> None:
        """The :class:`BlockStored` events of a confirmed load's blocks of group ``gid``
        (cached under ``hashes``) entering the device's prefix cache, as when a step caches
        blocks it filled: one per run of consecutive positions in its request's table
        (``state``)."""
        events = self._events
        if events is None:
            return
        request = state.request
        # The hashes the lookup made (they cover the hit the load is part of): hashing
        # further here could refuse a token past the admitted ones, half-way through the
        # confirmation (found by review: its slots and blocks were never released).
        fine = request.block_hashes
        stride = self._hash_stride[gid]
        # Each block's position: where the hash of the last hash block it covers sits.
        index_of = {
            fine[index * stride + stride - 1]: index for index in range(len(fine) // stride)
        }
        positions = sorted(index_of[digest] for digest in hashes)
        table = state.blocks[gid]
        start = 0
        for end in range(1, len(positions) + 1):
            if end == len(positions) or positions[end] != positions[end - 1] + 1:
                self._record_stored(
                    events, gid, request, fine, table, positions[start], positions[end - 1] + 1
                )
                start = end

    def _record_stored(
        self,
        events: list[KVCacheEvent],
        gid: int,
        request: Request,
        fine: Sequence[bytes],
        table: list[int],
        start: int,
        stop: int,
    ) -> None:
        """One :class:`BlockStored` per run of real blocks in ``table[start:stop]``: a null
        entry (a block the window skipped before its tokens were known) holds nothing."""
        tokens = self._block_tokens[gid]
        stride = self._hash_stride[gid]
        index = start
        while index < stop:
            if not table[index]:
                index += 1
                continue
            first = index
            while index < stop and table[index]:
                index += 1
            events.append(
                BlockStored(
                    group=gid,
                    block_hashes=tuple(fine[(first + 1) * stride - 1 : index * stride : stride]),
                    parent_block_hash=fine[first * stride - 1] if first else None,
                    block_size=tokens,
                    token_ids=tuple(request.token_ids[first * tokens : index * tokens]),
                )
            )

    def _update_limits(self, state: _Running) -> None:
        end_limit = known_limit = self.max_model_len + 1
        computed_limit = NEVER
        cacheable = self._cacheable
        rules = self.rules
        blocks = state.blocks
        num_skipped = state.num_skipped
        cache_at = state.cache_at
        for gid in self._holding:
            group = rules[gid]
            end = group.next_allocation_end(len(blocks[gid]))
            if end < end_limit:
                end_limit = end
            skip_at = group.next_skip_position(num_skipped[gid])
            if skip_at < computed_limit:
                computed_limit = skip_at
            if cacheable and cache_at[gid] < known_limit:
                known_limit = cache_at[gid]
        state.end_limit = end_limit
        state.known_limit = known_limit
        state.computed_limit = computed_limit
