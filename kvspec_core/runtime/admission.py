"""Admission: a request's first ``allocate_slots`` (checks its counts and the prefix passed,
revives the hit blocks, takes new ones, caches the prompt's full blocks, builds its
``_Running`` state). Its compiled twin is ``_native_src/admit.c``, used while none of
``fast_paths._ADMISSION_METHODS`` is overridden.
"""

from __future__ import annotations

from kvspec_core.errors import AllocatorError, KVSpecError
from kvspec_core.runtime.block_caching import BlockCaching
from kvspec_core.runtime.hashing import _INT_ONLY, _describe
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import STALE_PREFIX, Allocated, CachedPrefix, NotNow
from kvspec_core.runtime.running import _Running
from kvspec_core.runtime.tiers import TieredPrefix


class Admission(BlockCaching):
    """A request's first step (part of ``KVCacheAllocator``; methods for the reasons in
    ``base.py``)."""

    def _admit(
        self, request: Request, num_new_tokens: int, lookahead: int, prefix: CachedPrefix | None
    ) -> Allocated | NotNow:
        try:
            return self._admit_checked(request, num_new_tokens, lookahead, prefix)
        except KVSpecError:
            raise
        except Exception as error:
            raise self._plugin_error(error) from None

    def _admit_checked(
        self, request: Request, num_new_tokens: int, lookahead: int, prefix: CachedPrefix | None
    ) -> Allocated | NotNow:
        self._check_counts(request, num_new_tokens, lookahead)
        rid = request.request_id
        if request.num_encoder_tokens and not self._holds_encoder:
            raise AllocatorError(
                f"request {rid!r}: num_encoder_tokens={request.num_encoder_tokens}, but no "
                "group of this allocator holds encoder tokens (no cross-attention group, or "
                "its context's max_encoder_tokens is 0): the decoder's K/V would depend on "
                "an encoder input no block hash covers, a false prefix hit for a request "
                "with another. Pass 0 for a decoder-only model, or plan the encoder-decoder "
                "model with max_encoder_tokens"
            )
        if prefix is None and rid in self._freed:
            raise AllocatorError(
                f"request {rid!r} was freed; allocate_slots for it now would admit it again "
                "from token 0, not continue it. To re-admit it (after preemption), call "
                "find_cached_prefix(request) and pass prefix=...; to start over, use a new "
                "request id"
            )
        group_count = len(self.specs)
        if prefix is None:
            computed = 0
            blocks = [[] for _ in range(group_count)]  # type: list[list[int]]
        else:
            stale = self._check_prefix(request, prefix)
            if stale is not None:
                return NotNow(
                    reason=STALE_PREFIX,
                    group=stale,
                    message=(
                        f"cached blocks of group {stale} found for request {rid!r} were "
                        "evicted since; call find_cached_prefix again"
                    ),
                )
            computed = prefix.num_tokens
            blocks = [list(ids) for ids in prefix.block_ids]
        # Tier hits to load per group (those at positions the group still needs).
        loads: dict[int, list[tuple[int, int, int]]] = {}
        known = computed + num_new_tokens
        if known > self.max_model_len:
            return self._over_length(request, known)
        total = min(known + lookahead, self.max_model_len)
        num_skipped = [0] * group_count
        pools = self.pools
        need = [0] * len(pools)
        plans: list[tuple[int, int, int]] = []
        for gid in self._holding:
            rules = self.rules[gid]
            table = blocks[gid]
            skip = min(rules.skipped_tokens(computed) // self._block_tokens[gid], len(table))
            for index in range(skip):
                table[index] = 0  # never touched, so nothing to release
            num_skipped[gid] = skip
            if isinstance(prefix, TieredPrefix):
                kept = (
                    [entry for entry in prefix.loads[gid] if entry[0] >= skip]
                    if skip
                    else list(prefix.loads[gid])
                )
                if kept:
                    loads[gid] = kept
            nulls, real = rules.blocks_needed(len(table), known, total, request.num_encoder_tokens)
            held = len(table) - table.count(0) + real + len(loads.get(gid, ()))
            if held > self.admission_caps[gid]:
                return self._over_cap(request, gid, held)
            pool_index = self._pool_of[gid]
            # Hit blocks with no reference (cached free ones) leave the free blocks on revival.
            need[pool_index] += (
                real + len(loads.get(gid, ())) + pools[pool_index].num_unreferenced(table)
            )
            plans.append((gid, nulls, real))
        shortfall = self._shortfall(need, [0] * len(pools))
        if shortfall is not None:
            return shortfall
        self._preflight(
            request,
            known,
            {gid: len(blocks[gid]) + nulls + real for gid, nulls, real in plans},
            dict(enumerate(num_skipped)),
            [len(ids) for ids in prefix.block_ids] if prefix is not None else [0] * group_count,
            [0] * group_count,
        )
        state = _Running(request, known, blocks)
        state.num_skipped = num_skipped
        new_ids: list[tuple[int, ...]] = [()] * group_count
        # Revive every group's hit blocks before any group takes new ones: groups sharing
        # a pool would otherwise evict (and take) each other's not-yet-revived hit blocks.
        # _check_prefix found each of them cached (in use, or a cached free block).
        for gid, _, _ in plans:
            self._group_pools[gid].touch(blocks[gid], known_cached=True)
        if loads:
            assert self._tiers is not None
            self._tiers.admit_loads(
                rid,
                state,
                loads,
                blocks,
                self._hasher.hashes(request, computed),
                self._hash_stride,
                self._block_tokens,
                computed,
            )
            for gid, group_loads in loads.items():
                state.num_real[gid] += len(group_loads)
        for gid, nulls, real in plans:
            table = blocks[gid]
            pool = self._group_pools[gid]
            if nulls:
                table.extend([0] * nulls)
            if real:
                taken = pool.take(real)
                table.extend(taken)
                state.num_real[gid] += real
                new_ids[gid] = tuple(taken)
            if prefix is not None:
                # Hit blocks are cached already; caching resumes after them.
                state.num_cached[gid] = len(prefix.block_ids[gid])
        self._running[rid] = state
        self._freed.pop(rid, None)
        self._handed_out.pop(rid, None)
        if self._cacheable:
            self._cache_new_blocks(state, known)
        self._update_limits(state)
        return Allocated(new_block_ids=tuple(new_ids))

    def _check_prefix(self, request: Request, prefix: CachedPrefix) -> int | None:
        """Check that ``prefix`` is a hit this allocator would hand out for ``request``:
        the first group one of whose blocks was evicted since (a stale prefix), or None.

        Whatever made it (find_cached_prefix, attrs.evolve, another allocator), a prefix
        is taken only if it reads as a hit of this request here: ``num_tokens`` an int in
        ``[0, len(token_ids))``, each holding group's table ``num_tokens // block`` exact
        ints (other groups': empty), real wherever the group needs its blocks to resume
        (from ``skipped_tokens(num_tokens)`` on), and each real block cached in its group
        under the request's own hash at its position. A block that is not refuses it with
        :class:`AllocatorError` when no pool evicted anything since it was found (it never
        was this request's), else it is stale (``None`` is not returned)."""
        rid = request.request_id
        tiered = prefix.__class__ is TieredPrefix and self._tiers is not None
        if prefix.__class__ is not CachedPrefix and not tiered:
            raise AllocatorError(
                f"allocate_slots(request {rid!r}): prefix= must be the CachedPrefix "
                f"find_cached_prefix returned for it, not a {type(prefix).__name__}"
            )
        found_for = prefix.request_id
        if found_for.__class__ is not rid.__class__ or found_for != rid:
            raise AllocatorError(
                f"prefix found for request {_describe(found_for)} was passed for request "
                f"{rid!r}; pass the CachedPrefix find_cached_prefix returned for it"
            )
        num_tokens = prefix.num_tokens
        block_ids = prefix.block_ids
        group_count = len(self.specs)
        limit = self._lookup_limit(request)
        if num_tokens.__class__ is not int or not (num_tokens == 0 or 0 < num_tokens <= limit):
            raise self._forged(
                request,
                f"num_tokens={_describe(num_tokens)} is not in [0, {max(limit, 0)}] (the "
                "tokens, the last excluded; with a group caching only prompt blocks, the "
                "prompt)",
            )
        if block_ids.__class__ is not tuple or len(block_ids) != group_count:
            raise self._forged(request, f"block_ids must be a tuple of {group_count} tables")
        holding = set(self._holding)
        for gid, ids in enumerate(block_ids):
            tokens = self._block_tokens[gid]
            if gid in holding and num_tokens % tokens:
                raise self._forged(
                    request,
                    f"num_tokens={num_tokens} is not a whole number of group {gid}'s "
                    f"{tokens}-token blocks",
                )
            expected = num_tokens // tokens if gid in holding else 0
            if ids.__class__ is not tuple or len(ids) != expected:
                raise self._forged(
                    request,
                    f"group {gid}'s table must hold {expected} block ids for {num_tokens} tokens",
                )
            if set(map(type, ids)) - _INT_ONLY:
                raise self._forged(request, f"group {gid}'s block ids must be ints")
        if not num_tokens and not tiered:
            return None
        current = tuple(pool.epoch for pool in self.pools)
        entry = self._handed_out.get(rid)
        if (
            entry is not None
            and entry[0] is prefix
            and entry[1] is request
            and entry[2] is num_tokens
            and entry[3] is block_ids
            and entry[4] is prefix.epochs
            and current == prefix.epochs
        ):
            # Handed out for this very request, unchanged, nothing evicted since: every
            # block is still cached under its hash (the structure was checked above).
            return None
        fine = self._hasher.hashes(request, num_tokens)
        stale = None
        evicted_since = prefix.epochs.__class__ is not tuple or current != prefix.epochs
        loaded: list[set[int]] = [set() for _ in block_ids]
        if tiered:
            assert self._tiers is not None and isinstance(prefix, TieredPrefix)
            if not evicted_since and self._tiers.handed_out_unchanged(request, prefix):
                # Handed out for this very request, unchanged, no pool or tier evicted
                # since: every device block is still cached and every load's slot still
                # holds its hash (the structure was checked above).
                return None
            stale, why = self._tiers.check_loads(
                request, prefix, fine, self._holding, self._hash_stride
            )
            if why is not None:
                raise self._forged(request, why)
            loaded = [{entry[0] for entry in group} for group in prefix.loads]
        for gid in self._holding:
            ids = block_ids[gid]
            skip = self.rules[gid].skipped_tokens(num_tokens) // self._block_tokens[gid]
            if not all(
                block or index in loaded[gid] for index, block in enumerate(ids[skip:], skip)
            ):
                raise self._forged(
                    request,
                    f"group {gid} needs its blocks from {skip} on to "
                    "resume, the table has null entries there",
                )
            stride = self._hash_stride[gid]
            cache = self._caches[gid]
            for index, block in enumerate(ids):
                if block and cache.get(fine[(index + 1) * stride - 1]) != block:
                    if not evicted_since:
                        raise self._forged(
                            request,
                            f"block {block} at position {index} of group {gid} is "
                            "not cached for this request's tokens here",
                        )
                    if stale is None:
                        stale = gid
        return stale

    def _forged(self, request: Request, detail: str) -> AllocatorError:
        return AllocatorError(
            f"allocate_slots(request {request.request_id!r}): the prefix passed is not one "
            f"this allocator handed out for this request: {detail}; pass the CachedPrefix "
            "find_cached_prefix returned for it (unchanged)"
        )
