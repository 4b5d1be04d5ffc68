"""The block pool: ref counts, free blocks, the prefix-cache map. No per-block objects.

Per block the pool keeps an 8-byte ref count slot (a list of small ints: three times faster
to update than an ``array`` of C ints), an 8-byte slot for its cached hash, a 2-byte
group id and a 1-byte "reused" flag; free blocks that hold no cached prefix sit in a
4-byte-per-entry stack. Free blocks that do hold a cached prefix stay findable until
evicted (ordered dicts give O(1) removal when a hit revives one, and O(1) eviction).
Uncached free blocks are always handed out before any cached block is evicted.

Eviction order (``eviction=``):

* ``"lru"`` (default): vLLM's order. One LRU over all cached free blocks, least recently
  freed first; a request's blocks are freed tail of the sequence first (so a prefix's last
  blocks are evicted before its first ones), and a prefix hit takes a block out of the order.
  Uncached free blocks are handed out before any cached block, as vLLM's free queue does.
* ``"segmented"``: a segmented LRU. Cached blocks that a prefix hit has reused at least once
  are evicted only after every never-reused one. It keeps a few hot system prompts longer
  (shared-prompt trace, tight pool: +4% hit tokens) but evicts the newest turn of every chat
  conversation first, before the old turns it protects (chat trace: 62% of LRU's hit tokens
  with full attention), so it is an option, not the default. See the runtime README.

Block 0 is the null block: it stands for "no block here" in block tables (skipped
sliding-window blocks, Mamba positions without a state) and is never handed out.
"""

from __future__ import annotations

import operator
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from kvspec_core.runtime.native import native

#: Id of the null block in every pool.
NULL_BLOCK = 0

#: Most groups one pool can serve (group ids are stored in 2 bytes per block).
MAX_GROUPS_PER_POOL = 1 << 16

#: Most blocks one pool may hold (ids are stored as 4-byte signed ints).
MAX_POOL_BLOCKS = (1 << 31) - 1

#: Accepted values of ``BlockPool(eviction=...)``.
EVICTION_POLICIES = ("lru", "segmented")
#: The eviction order pools and allocators use unless told otherwise (vLLM's).
DEFAULT_EVICTION = "lru"


class BlockPool:
    """Blocks ``1 .. num_blocks - 1`` of one physical pool, shared by ``group_ids``.

    ``epoch`` changes whenever a cached block is evicted or the cache is reset, so a prefix
    found earlier can be checked for staleness in O(1).
    """

    def __init__(
        self,
        num_blocks: int,
        group_ids: Sequence[int] = (0,),
        *,
        events: list[KVCacheEvent] | None = None,
        eviction: str = DEFAULT_EVICTION,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise AllocatorError(f"BlockPool.num_blocks={num_blocks!r} must be an int")
        if not 2 <= num_blocks <= MAX_POOL_BLOCKS:
            raise AllocatorError(
                f"BlockPool.num_blocks={num_blocks} must be in [2, {MAX_POOL_BLOCKS}]: one "
                "block is the null block and at least one must be usable"
            )
        if not group_ids or any(not 0 <= gid < MAX_GROUPS_PER_POOL for gid in group_ids):
            raise AllocatorError(
                f"BlockPool.group_ids={tuple(group_ids)!r} must be a non-empty sequence of ids "
                f"in [0, {MAX_GROUPS_PER_POOL})"
            )
        if eviction not in EVICTION_POLICIES:
            raise AllocatorError(
                f"BlockPool.eviction={eviction!r} is invalid: must be one of {EVICTION_POLICIES}"
            )
        self.eviction = eviction
        self.num_blocks = num_blocks
        self.group_ids = tuple(group_ids)
        self.ref_counts: list[int] = [0] * num_blocks
        # Popping from the end hands out 1, 2, 3, ... first.
        self._fresh = array("i", range(num_blocks - 1, 0, -1))
        # Built with the compiled kernels: its eviction orders are their BlockQueues, which
        # they need (the Python code serves either kind).
        self._compiled = native is not None
        # Cached free blocks never reused by a hit (evicted first), and reused ones: ordered
        # sets, OrderedDicts or the compiled BlockQueue (same interface, no per-entry object).
        self._evictable: OrderedDict[int, None] = (
            OrderedDict() if native is None else native.BlockQueue(num_blocks)
        )
        self._protected: OrderedDict[int, None] = (
            OrderedDict() if native is None else native.BlockQueue(num_blocks)
        )
        self._reused = bytearray(num_blocks)
        self._segmented = eviction == "segmented"
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_group = array("H", [self.group_ids[0]]) * num_blocks
        #: Per group: block hash -> block id of the cached block.
        self.caches: dict[int, dict[bytes, int]] = {gid: {} for gid in self.group_ids}
        self._events = events
        self.epoch = 0
        #: Called as ``(groups, hashes, blocks)`` with the cached blocks an eviction takes
        #: out of the cache, before they are handed out (offload tiers store them; see
        #: ``offloading.py``). Set, the kernels' evictions go through :meth:`take`
        #: (``pool_access.c``).
        self._on_evict: Callable[[list[int], list[bytes], list[int]], None] | None = None

    # ----------------------------------------------------------------- counts
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free + evictable cached)."""
        return len(self._fresh) + len(self._evictable) + len(self._protected)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix cache (in use or evictable)."""
        return sum(len(cache) for cache in self.caches.values())

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._evictable or block_id in self._protected

    def cached_hash(self, block_id: int) -> bytes | None:
        return self._block_hash[block_id]

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many non-null ``blocks`` no request holds (cached free blocks, which leave
        the free blocks when a prefix hit revives them)."""
        refs = self.ref_counts
        kernels = native if self._compiled else None
        if kernels is not None:
            return kernels.count_unreferenced(blocks, refs)
        _check_block_ids(blocks, len(refs))
        return [refs[block] for block in blocks if block].count(0)

    # ----------------------------------------------------------------- handing out
    def take(self, count: int) -> list[int]:
        """``count`` blocks with ref count 1: uncached ones first, then cached ones in
        eviction order (see ``eviction``), which leave the prefix cache."""
        fresh = self._fresh
        if count == 1 and fresh:
            # One uncached block (a decode step's new block): the common case.
            block = fresh.pop()
            self.ref_counts[block] = 1
            return [block]
        if count > self.num_free_blocks or count < 0:
            raise AllocatorError(
                f"asked for {count} blocks but only {self.num_free_blocks} are free"
            )
        available = len(fresh)
        refs = self.ref_counts
        if count <= available:
            blocks = fresh[available - count :].tolist()
            del fresh[available - count :]
        else:
            blocks = fresh.tolist()
            del fresh[:]
            try:
                return self._take_evicting(count - available, blocks)
            except BaseException:
                # An eviction hook (an offload tier) refused, or the eviction failed: what
                # was taken is handed back, nothing lost.
                self._give_back(blocks)
                raise
        for block in blocks:
            refs[block] = 1
        return blocks

    def _take_evicting(self, count: int, blocks: list[int]) -> list[int]:
        """:meth:`take` past the uncached blocks (``blocks``, all of them, ref counts still
        0): ``count`` cached free blocks evicted onto ``blocks``, every one then at ref
        count 1. On an exception the blocks evicted so far are on ``blocks`` (or given back
        by :meth:`_evict`)."""
        refs = self.ref_counts
        available = len(blocks)
        if self._events is None and len(self._evictable) >= count:
            # Never-reused cached blocks cover the rest (the steady state of a full
            # pool; their reused flag is 0 already): evict and hand out in one pass.
            on_evict = self._on_evict
            # What the hook is told: the victims' groups and hashes, in eviction order,
            # as cached (collected by the eviction itself).
            groups: list[int] | None = None if on_evict is None else []
            hashes: list[bytes] | None = None if on_evict is None else []
            kernels = native if self._compiled else None
            if kernels is not None:
                kernels.evict_take(
                    count,
                    blocks,
                    self._evictable,
                    self.caches,
                    self._block_group,
                    self._block_hash,
                    refs,
                    groups,
                    hashes,
                )
            else:
                self._evict_take(count, blocks, groups, hashes)
            self.epoch += 1
            for block in blocks[:available]:
                refs[block] = 1
            if on_evict is not None:
                on_evict(groups, hashes, blocks[available:])  # type: ignore[arg-type]
            return blocks
        blocks.extend(self._evict(count))
        for block in blocks:
            refs[block] = 1
        return blocks

    def _give_back(self, blocks: list[int]) -> None:
        """``blocks``, taken by a take that failed, free and uncached again (an evicted one
        has left the cache already): ref count 0, back on the free stack."""
        refs = self.ref_counts
        for block in blocks:
            refs[block] = 0
        self._fresh.extend(blocks)

    def _evict_take(
        self,
        count: int,
        out: list[int],
        groups: list[int] | None = None,
        hashes: list[bytes] | None = None,
    ) -> None:
        """Pop ``count`` never-reused cached free blocks, oldest first, out of the cache and
        onto ``out`` with ref count 1, and, where given, each one's group id onto
        ``groups`` and its hash onto ``hashes`` (``native.evict_take`` in Python)."""
        caches = self.caches
        block_group = self._block_group
        block_hash = self._block_hash
        refs = self.ref_counts
        popitem = self._evictable.popitem
        append = out.append
        only_cache = next(iter(caches.values())) if len(caches) == 1 else None
        for _ in range(count):
            block = popitem(False)[0]
            gid = block_group[block]
            digest = block_hash[block]
            if groups is not None:
                groups.append(gid)
            if hashes is not None:
                hashes.append(digest)  # type: ignore[arg-type]
            cache = only_cache if only_cache is not None else caches[gid]
            del cache[digest]  # type: ignore[arg-type]
            block_hash[block] = None
            refs[block] = 1
            append(block)

    def _evict(self, count: int) -> list[int]:
        evictable = self._evictable
        block_hash = self._block_hash
        block_group = self._block_group
        reused = self._reused
        caches = self.caches
        if self._events is not None:
            removed: dict[int, list[bytes]] = {}
            for block in self._eviction_order(count):
                removed.setdefault(block_group[block], []).append(block_hash[block])  # type: ignore[arg-type]
            for gid, digests in removed.items():
                self._events.append(BlockRemoved(group=gid, block_hashes=tuple(digests)))
        victims: list[int] = []
        append = victims.append
        protected = self._protected
        on_evict = self._on_evict
        groups: list[int] = []
        hashes: list[bytes] = []
        for _ in range(count):
            block = (evictable if evictable else protected).popitem(last=False)[0]
            append(block)
            reused[block] = 0
            gid = block_group[block]
            digest = block_hash[block]
            if on_evict is not None:
                groups.append(gid)
                hashes.append(digest)  # type: ignore[arg-type]
            # Only the block a hash maps to is ever marked cached (see cache_blocks).
            del caches[gid][digest]  # type: ignore[arg-type]
            block_hash[block] = None
        self.epoch += 1
        if on_evict is not None:
            try:
                on_evict(groups, hashes, victims)
            except BaseException:
                self._give_back(victims)
                raise
        return victims

    def _eviction_order(self, count: int) -> list[int]:
        order: list[int] = []
        for segment in (self._evictable, self._protected):
            for block in segment:
                if len(order) == count:
                    return order
                order.append(block)
        return order

    def touch(self, blocks: Iterable[int], *, known_cached: bool = False) -> None:
        """Add a reference to each cached block a prefix hit reuses; revived free blocks
        leave the eviction order, and all are marked reused (see ``eviction``). Refuses
        (changing nothing) a block that is neither in use nor a cached free block.
        ``known_cached``: the caller found every block in this pool's cache with nothing
        evicted since (the allocator's own prefix at an unchanged epoch), so the check is
        skipped."""
        refs = self.ref_counts
        reused = self._reused
        blocks = list(blocks)
        evictable = self._evictable
        protected = self._protected
        num_blocks = self.num_blocks
        kernels = native if self._compiled else None
        if kernels is not None:
            bad = kernels.touch(
                blocks, refs, reused, evictable, protected, self._segmented, not known_cached
            )
            if bad >= 0:
                raise self._not_reusable(blocks[bad])
            return
        # As the compiled twin refuses them: no int (any call), out of range (unchecked).
        _check_block_ids(blocks, num_blocks if known_cached else None)
        if not known_cached:
            for block in blocks:
                if block and not (
                    0 < block < num_blocks
                    and (refs[block] or block in evictable or block in protected)
                ):
                    raise self._not_reusable(block)
        for block in blocks:
            if block:
                count = refs[block]
                if count == 0:
                    if reused[block]:
                        del protected[block]
                    else:
                        del evictable[block]
                if self._segmented:
                    reused[block] = 1
                refs[block] = count + 1

    def _not_reusable(self, block: int) -> AllocatorError:
        return AllocatorError(
            f"block {block} is neither in use nor a cached free block of this "
            f"pool (ids 1..{self.num_blocks - 1}); a prefix hit cannot reuse it"
        )

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free. Blocks freed
        earlier are evicted earlier. Refuses (changing nothing) if a count would go negative."""
        self.check_release(blocks)
        self._release_unchecked(blocks)

    def check_release(self, blocks: Sequence[int]) -> None:
        """Raise :class:`AllocatorError` if releasing ``blocks`` would corrupt the pool."""
        refs = self.ref_counts
        if not blocks:
            return
        if min(blocks) < 0 or max(blocks) >= self.num_blocks:
            bad = next(block for block in blocks if not 0 <= block < self.num_blocks)
            raise AllocatorError(
                f"block id {bad} is not in this pool (ids 1..{self.num_blocks - 1})"
            )
        counts = [refs[block] for block in blocks if block]
        if counts and min(counts) <= 0:
            bad = next(block for block in blocks if block and refs[block] <= 0)
            raise AllocatorError(
                f"block {bad} has ref count {refs[bad]}; releasing it again would make "
                "it negative (double free)"
            )
        if len(set(blocks)) != len(blocks):
            times_released: dict[int, int] = {}
            for block in blocks:
                if block:
                    times_released[block] = times_released.get(block, 0) + 1
            for block, times in times_released.items():
                if times > refs[block]:
                    raise AllocatorError(
                        f"block {block} released {times} times but has ref count {refs[block]}"
                    )

    def _release_unchecked(self, blocks: Sequence[int], *, reverse: bool = False) -> None:
        """Release as :meth:`release` does, unchecked (the caller knows every count stays
        >= 0); ``reverse``: last block first."""
        kernels = native if self._compiled else None
        if kernels is not None and blocks.__class__ is list:
            kernels.release(
                blocks,
                reverse,
                self.ref_counts,
                self._block_hash,
                self._reused,
                self._fresh,
                self._evictable,
                self._protected,
            )
            return
        _check_block_ids(blocks, len(self.ref_counts))  # as the compiled twin, up front
        if reverse:
            blocks = blocks[::-1]
        refs = self.ref_counts
        block_hash = self._block_hash
        evictable = self._evictable
        protected = self._protected
        reused = self._reused
        fresh = self._fresh
        for block in blocks:
            if block:
                count = refs[block] - 1
                refs[block] = count
                if count == 0:
                    if block_hash[block] is None:
                        fresh.append(block)
                    elif reused[block]:
                        protected[block] = None
                    else:
                        evictable[block] = None

    # ----------------------------------------------------------------- prefix cache
    def cache_blocks(self, gid: int, digests: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Make in-use ``blocks`` findable under ``digests`` for group ``gid``. A hash
        cached already moves to the new block, a copy a request has just computed again (in
        a hybrid model: a group's own hit went further than the common one), so the hash
        lives as long as its newest copy, as in vLLM; the old copy leaves the cache (once
        free, it is handed out before any cached block), where vLLM 0.32 keeps every copy
        cached and a hit takes the oldest (kvspec-vllm's shadow mode counts the resulting
        free-block differences as expected, reason ``copies``). Returns how many blocks
        were newly cached."""
        gid = operator.index(gid)  # as the compiled twin reads it (a float is refused)
        cache = self.caches[gid]
        block_hash = self._block_hash
        block_group = self._block_group
        # One group: every block's group id is that group's already (set at creation).
        shared = len(self.caches) > 1
        kernels = native if self._compiled else None
        if kernels is not None and digests.__class__ is list and blocks.__class__ is list:
            return kernels.cache_blocks(
                gid,
                digests,
                blocks,
                cache,
                block_hash,
                block_group if shared else None,
                self._move_hash,
            )
        # Every id checked before anything changes, as the compiled twin does.
        _check_block_ids(blocks[: len(digests)], len(block_hash))
        stored = 0
        # strict=False: the compiled twin (pool.c) stops at the shorter list too, and the two
        # must answer alike; the callers pass equal lengths, and a shorter list only caches
        # fewer blocks (the pairs stay aligned: no hash can name the wrong block).
        for digest, block in zip(digests, blocks, strict=False):
            if block and block_hash[block] is None:
                old = cache.setdefault(digest, block)
                if old != block:
                    self._move_hash(cache, digest, old, block)
                block_hash[block] = digest
                if shared:
                    block_group[block] = gid
                stored += 1
        return stored

    def _move_hash(self, cache: dict[bytes, int], digest: bytes, old: int, new: int) -> None:
        """``digest`` now names ``new``; ``old`` leaves the prefix cache (its content stays
        valid for the requests using it; free, it joins the uncached free blocks) and hands
        its reused flag to ``new``."""
        cache[digest] = new
        self._block_hash[old] = None
        if self._reused[old]:
            self._reused[old] = 0
            self._reused[new] = 1
            if not self.ref_counts[old]:
                del self._protected[old]
                self._fresh.append(old)
        elif not self.ref_counts[old]:
            del self._evictable[old]
            self._fresh.append(old)
        # A prefix found before may name ``old``: allocate_slots checks it again.
        self.epoch += 1

    def reset_prefix_cache(self, *, record_event: bool = True) -> None:
        """Forget every cached prefix. Blocks in use stay with their requests (uncached);
        free cached blocks become plain free blocks. ``record_event=False`` leaves the
        :class:`AllBlocksCleared` event to the caller (one per reset of several pools)."""
        block_hash = self._block_hash
        for cache in self.caches.values():
            for block in cache.values():
                block_hash[block] = None
            cache.clear()
        for segment in (self._evictable, self._protected):
            self._fresh.extend(segment)
            segment.clear()
        self._reused = bytearray(self.num_blocks)
        self.epoch += 1
        if record_event and self._events is not None:
            self._events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Raise :class:`AllocatorError` if internal bookkeeping is inconsistent (tests)."""
        refs = self.ref_counts
        fresh = set(self._fresh)
        if len(fresh) != len(self._fresh) or NULL_BLOCK in fresh:
            raise AllocatorError("free stack holds duplicates or the null block")
        for block in range(1, self.num_blocks):
            count = refs[block]
            if count < 0:
                raise AllocatorError(f"block {block} has negative ref count {count}")
            free_here = (block in fresh) + (block in self._evictable) + (block in self._protected)
            if count == 0 and free_here != 1:
                raise AllocatorError(f"block {block} has ref count 0 but is free {free_here} times")
            if count > 0 and free_here:
                raise AllocatorError(f"block {block} is in use ({count}) and free")
            if block in fresh and self._block_hash[block] is not None:
                raise AllocatorError(f"uncached free block {block} still holds a cached prefix")
            if block in self._evictable and (
                self._block_hash[block] is None or self._reused[block]
            ):
                raise AllocatorError(f"evictable block {block} holds no cached prefix or is reused")
            if block in self._protected and (
                self._block_hash[block] is None or not self._reused[block]
            ):
                raise AllocatorError(f"protected block {block} holds no cached prefix or is unused")
        for gid, cache in self.caches.items():
            for digest, block in cache.items():
                if self._block_hash[block] != digest or self._block_group[block] != gid:
                    raise AllocatorError(f"cache entry of group {gid} -> block {block} is stale")


def _check_block_ids(blocks: Iterable[int], size: int | None) -> None:
    """Refuse a block id that is no int (TypeError) or, unless ``size`` is None, outside
    ``[0, size)`` (IndexError), with the compiled kernels' messages (``block_id`` /
    ``block_in_range`` in pool.c), so the two twins refuse the same ids alike."""
    for block in blocks:
        if block.__class__ is not int:
            raise TypeError(f"block ids must be ints, not {type(block).__name__}")
        if size is not None and not 0 <= block < size:
            raise IndexError(f"block id {block} is not in this pool (0..{size - 1})")
