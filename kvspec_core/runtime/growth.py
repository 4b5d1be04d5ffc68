"""Growth: a running request's ``allocate_slots`` past one of its thresholds (free the
blocks it no longer needs, take new ones, cache the full ones). ``_grow_checked`` is the
general path (asks each group's rules); ``_grow_dense`` the short one for allocators whose
groups all follow the core's full-attention rules. Compiled twins: ``_native_src/grow.c``
(``_grow_dense``, one group) and ``group_step.c`` (``_grow_checked`` for the core's
parametric rule shapes).
"""

from __future__ import annotations

from kvspec_core.errors import KVSpecError
from kvspec_core.runtime.block_caching import BlockCaching
from kvspec_core.runtime.results import Allocated, NotNow
from kvspec_core.runtime.rules import NEVER
from kvspec_core.runtime.running import _Running


class Growth(BlockCaching):
    """A running request's block-boundary steps (part of ``KVCacheAllocator``; methods for
    the reasons in ``base.py``)."""

    def _grow(self, state: _Running, num_new_tokens: int, lookahead: int) -> Allocated | NotNow:
        try:
            return self._grow_checked(state, num_new_tokens, lookahead)
        except KVSpecError:
            raise
        except Exception as error:
            raise self._plugin_error(error) from None

    def _grow_checked(
        self, state: _Running, num_new_tokens: int, lookahead: int
    ) -> Allocated | NotNow:
        request = state.request
        if (
            type(num_new_tokens) is not int
            or type(lookahead) is not int
            or num_new_tokens < 0
            or lookahead < 0
        ):
            self._check_counts(request, num_new_tokens, lookahead)
        computed = state.computed
        known = computed + num_new_tokens
        max_len = self.max_model_len
        if known > max_len:
            return self._over_length(request, known)
        total = known + lookahead
        if total > max_len:
            total = max_len
        if total < state.end_limit and computed < state.computed_limit:
            # Only a block became full: nothing to allocate or free, just cache it.
            self._preflight(request, known, {}, {}, state.num_cached, state.cache_at)
            state.computed = known
            known_limit = self.max_model_len + 1
            if self._cacheable:
                self._cache_new_blocks(state, known)
                for gid in self._holding:
                    if state.cache_at[gid] < known_limit:
                        known_limit = state.cache_at[gid]
            state.known_limit = known_limit
            return self._no_new_blocks
        pools = self.pools
        need = [0] * len(pools)
        freed = [0] * len(pools)
        plans: list[tuple[int, int, int, int]] = []
        blocks = state.blocks
        for gid in self._holding:
            rules = self.rules[gid]
            table = blocks[gid]
            done = state.num_skipped[gid]
            skip = rules.skipped_tokens(computed) // self._block_tokens[gid]
            if skip > len(table):
                skip = len(table)
            if skip < done:
                skip = done
            nulls, real = rules.blocks_needed(len(table), known, total, request.num_encoder_tokens)
            if not (nulls or real or skip > done):
                continue
            pool_index = self._pool_of[gid]
            if skip > done:
                refs = pools[pool_index].ref_counts
                dropped = [block for block in table[done:skip] if block]
                freed[pool_index] += [refs[block] for block in dropped].count(1)
                num_dropped = len(dropped)
            else:
                num_dropped = 0
            if real:
                held = state.num_real[gid] - num_dropped + real
                if held > self.admission_caps[gid]:
                    return self._over_cap(request, gid, held)
            need[pool_index] += real
            plans.append((gid, skip, nulls, real))
        shortfall = self._shortfall(need, freed)
        if shortfall is not None:
            return shortfall
        if self._guarded:
            lengths = {gid: len(blocks[gid]) + nulls + real for gid, _, nulls, real in plans}
            skips = {gid: skip for gid, skip, _, _ in plans}
        else:
            # Only plugin rules are asked in advance (core rules cannot raise).
            lengths = skips = {}
        self._preflight(request, known, lengths, skips, state.num_cached, state.cache_at)
        new_ids: list[tuple[int, ...]] = [()] * len(blocks)
        for gid, skip, _, _ in plans:
            done = state.num_skipped[gid]
            if skip > done:
                table = blocks[gid]
                # Later blocks first: they are evicted first, the shared prefix survives.
                dropped = [block for block in reversed(table[done:skip]) if block]
                table[done:skip] = [0] * (skip - done)
                state.num_skipped[gid] = skip
                state.num_real[gid] -= len(dropped)
                self._group_pools[gid]._release_unchecked(dropped)
        for gid, _, nulls, real in plans:
            table = blocks[gid]
            if nulls:
                table.extend([0] * nulls)
            if real:
                taken = self._group_pools[gid].take(real)
                table.extend(taken)
                state.num_real[gid] += real
                new_ids[gid] = tuple(taken)
        state.computed = known
        if self._cacheable:
            self._cache_new_blocks(state, known)
        self._update_limits(state)
        if not plans:
            return self._no_new_blocks
        return Allocated(new_block_ids=tuple(new_ids))

    def _grow_dense(
        self, state: _Running, num_new_tokens: int, lookahead: int
    ) -> Allocated | NotNow:
        """:meth:`_grow_checked` for allocators whose groups all follow the core's
        full-attention rules (see ``_dense``): nothing is ever skipped, a group needs
        ``cdiv(total, block_tokens)`` blocks and caches every full one. Same results and
        state as the general path, which the tests compare on random traces."""
        request = state.request
        max_len = self.max_model_len
        known = state.computed + num_new_tokens
        if known > max_len:
            return self._over_length(request, known)
        total = known + lookahead
        if total > max_len:
            total = max_len
        blocks = state.blocks
        block_tokens = self._block_tokens
        takes: list[tuple[int, int]] = []
        for gid in self._holding:
            real = -(-total // block_tokens[gid]) - len(blocks[gid])
            if real > 0:
                held = state.num_real[gid] + real
                if held > self.admission_caps[gid]:
                    return self._over_cap(request, gid, held)
                takes.append((gid, real))
        if takes:
            need = [0] * len(self.pools)
            for gid, real in takes:
                need[self._pool_of[gid]] += real
            shortfall = self._shortfall(need, [0] * len(self.pools))
            if shortfall is not None:
                return shortfall
        cacheable = self._cacheable
        available = len(request.token_ids)
        cached_upto = known if known < available else available
        if cacheable and (cached_upto >= state.known_limit or self._hash_finer):
            # Hash before anything changes: bad token ids refuse the step here (as the
            # general path's preflight, which hashes every completed hash block).
            fine = self._hasher.hashes(request, cached_upto)
        new_ids: list[tuple[int, ...]] = [()] * len(blocks)
        for gid, real in takes:
            taken = self._group_pools[gid].take(real)
            blocks[gid].extend(taken)
            state.num_real[gid] += real
            new_ids[gid] = tuple(taken)
        state.computed = known
        end_limit = known_limit = max_len + 1
        num_cached = state.num_cached
        cache_at = state.cache_at
        for gid in self._holding:
            tokens = block_tokens[gid]
            table = blocks[gid]
            end = len(table) * tokens + 1
            if end < end_limit:
                end_limit = end
            if cacheable:
                if cached_upto >= cache_at[gid]:
                    start = num_cached[gid]
                    stop = cached_upto // tokens
                    stride = self._hash_stride[gid]
                    self._group_pools[gid].cache_blocks(
                        gid,
                        fine[(start + 1) * stride - 1 : stop * stride : stride],
                        table[start:stop],
                    )
                    num_cached[gid] = stop
                    cache_at[gid] = (stop + 1) * tokens
                if cache_at[gid] < known_limit:
                    known_limit = cache_at[gid]
        state.end_limit = end_limit
        state.known_limit = known_limit
        state.computed_limit = NEVER
        if not takes:
            return self._no_new_blocks
        return Allocated(new_block_ids=tuple(new_ids))
