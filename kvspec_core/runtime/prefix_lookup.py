"""Prefix lookup: ``find_cached_prefix``, the longest prefix every group can resume from
(the coordinator's fixed point; one scan for a one-group full-attention allocator).
Compiled twin: ``_native_src/find.c`` (``native.find_prefix``, set as the instance's
``find_cached_prefix`` by ``fast_paths.py``; it calls ``_find_cached_prefix`` for every
request it does not answer).
"""

from __future__ import annotations

from kvspec_core.errors import AllocatorError, KVSpecError
from kvspec_core.runtime.base import AllocatorBase
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import CachedPrefix
from kvspec_core.runtime.running import _id_error, _is_id
from kvspec_core.runtime.tiers import TieredPrefix

#: Prefixes handed out and not yet admitted that an admission trusts without a per-block
#: check (see ``_check_prefix``); past this many, forgotten (their admissions check them).
_HANDED_OUT_KEPT = 4096


class PrefixLookup(AllocatorBase):
    """``find_cached_prefix`` (part of ``KVCacheAllocator``; a method for the reasons in
    ``base.py``)."""

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest prefix of ``request`` that every group can resume from.

        At most ``num_tokens - 1`` tokens (the last prompt token is always computed, to
        produce logits). Each family's rules state what resuming needs; groups are asked in
        turn, each at most the current hit, until none lowers it (a fixed point), so the
        answer never includes a position some group cannot resume from.

        When state groups (Mamba) hold the hit below where the prompt shares cached
        attention content, ``checkpoint_at`` names that position: an engine that ends a
        prefill step exactly there saves the state, and later requests resume from it.
        """
        if not _is_id(request.request_id):
            raise AllocatorError(_id_error(request.request_id, "find_cached_prefix"))
        if request.request_id in self._running:
            raise AllocatorError(
                f"request {request.request_id!r} is already running; look up prefixes only "
                "before its first allocate_slots"
            )
        empty = tuple(() for _ in self.specs)
        epochs = tuple(pool.epoch for pool in self.pools)
        max_tokens = self._lookup_limit(request)
        if not self._cacheable or max_tokens < self.hash_block_size:
            return CachedPrefix(
                request_id=request.request_id, num_tokens=0, block_ids=empty, epochs=epochs
            )
        fine = self._hasher.hashes(request, max_tokens)
        tiers = self._tiers
        if tiers is not None:
            # Every group's rules decide over its device and tier entries together.
            try:
                hit, found, checkpoint_at = self._coordinator.find(
                    fine, max_tokens, tiers.views, tiers.scans
                )
            except KVSpecError:
                raise
            except Exception as error:
                raise self._plugin_error(error) from None
            prefix = tiers.prefix(
                request.request_id,
                hit,
                found,
                checkpoint_at,
                epochs,
                len(self.specs),
                self._block_tokens,
                self.hash_block_size,
            )
            if isinstance(prefix, TieredPrefix):
                tiers.hand_out(request, prefix)
                return prefix
            hit = prefix.num_tokens
        elif self._single_full:
            # One full-attention group whose blocks are hash blocks: its longest cached run
            # is the hit (the coordinator's fixed point, reached in one question).
            tokens = self._block_tokens[0]
            hit_blocks = self._coordinator.hit_scans[0](fine, self._caches[0], max_tokens // tokens)
            hit, checkpoint_at = len(hit_blocks) * tokens, None
            block_ids: tuple[tuple[int, ...], ...] = (tuple(hit_blocks),)
        else:
            try:
                hit, found, checkpoint_at = self._coordinator.find(fine, max_tokens)
            except KVSpecError:
                raise
            except Exception as error:
                raise self._plugin_error(error) from None
            block_ids = tuple(
                tuple(found[gid]) if gid in found else () for gid in range(len(self.specs))
            )
        if tiers is None:
            prefix = CachedPrefix(
                request_id=request.request_id,
                num_tokens=hit,
                block_ids=block_ids,
                epochs=epochs,
                checkpoint_at=checkpoint_at,
            )
        if hit:
            handed = self._handed_out
            if len(handed) >= _HANDED_OUT_KEPT:
                handed.clear()
            handed[request.request_id] = (
                prefix,
                request,
                prefix.num_tokens,
                prefix.block_ids,
                prefix.epochs,
            )
        return prefix

    #: The method itself, also under this name: what an instance's compiled lookup
    #: (``native.find_prefix``, its ``find_cached_prefix`` when the kernels are built) calls
    #: for every request it does not answer itself.
    _find_cached_prefix = find_cached_prefix
