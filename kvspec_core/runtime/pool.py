"""The block pool: ref counts, free blocks, the prefix-cache map. No per-block objects.

Per block the pool keeps a 4-byte ref count, an 8-byte slot for its cached hash and a
2-byte group id; free blocks that hold no cached prefix sit in a 4-byte-per-entry stack.
Free blocks that do hold a cached prefix stay findable until evicted, least recently freed
first (an ordered dict gives O(1) removal when a hit revives one, and O(1) eviction). Uncached free
blocks are always handed out before any cached block is evicted.

Block 0 is the null block: it stands for "no block here" in block tables (skipped
sliding-window blocks, Mamba positions without a state) and is never handed out.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.events import AllBlocksCleared, BlockRemoved, KVCacheEvent

#: Id of the null block in every pool.
NULL_BLOCK = 0

#: Most groups one pool can serve (group ids are stored in 2 bytes per block).
MAX_GROUPS_PER_POOL = 1 << 16

#: Most blocks one pool may hold (ids are stored as 4-byte signed ints).
MAX_POOL_BLOCKS = (1 << 31) - 1


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
        self.num_blocks = num_blocks
        self.group_ids = tuple(group_ids)
        self.ref_counts = array("i", bytes(4 * num_blocks))
        # Popping from the end hands out 1, 2, 3, ... first.
        self._fresh = array("i", range(num_blocks - 1, 0, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_group = array("H", bytes(2 * num_blocks))
        #: Per group: block hash -> block id of the cached block.
        self.caches: dict[int, dict[bytes, int]] = {gid: {} for gid in self.group_ids}
        self._events = events
        self.epoch = 0

    # ----------------------------------------------------------------- counts
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free + evictable cached)."""
        return len(self._fresh) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._fresh) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix cache (in use or evictable)."""
        return sum(len(cache) for cache in self.caches.values())

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._evictable

    def cached_hash(self, block_id: int) -> bytes | None:
        return self._block_hash[block_id]

    # ----------------------------------------------------------------- handing out
    def take(self, count: int) -> list[int]:
        """``count`` blocks with ref count 1: uncached ones first, then the least recently
        freed cached ones (evicted from the prefix cache)."""
        fresh = self._fresh
        if count > len(fresh) + len(self._evictable) or count < 0:
            raise AllocatorError(
                f"asked for {count} blocks but only {len(fresh) + len(self._evictable)} are free"
            )
        available = len(fresh)
        if count <= available:
            blocks = fresh[available - count :].tolist()
            del fresh[available - count :]
        else:
            blocks = fresh.tolist()
            del fresh[:]
            blocks.extend(self._evict(count - available))
        refs = self.ref_counts
        for block in blocks:
            refs[block] = 1
        return blocks

    def _evict(self, count: int) -> list[int]:
        evictable = self._evictable
        block_hash = self._block_hash
        block_group = self._block_group
        caches = self.caches
        removed: dict[int, list[bytes]] = {}
        victims = []
        popitem = evictable.popitem
        for _ in range(count):
            block = popitem(last=False)[0]
            victims.append(block)
            digest = block_hash[block]
            block_hash[block] = None
            gid = block_group[block]
            cache = caches[gid]
            if cache.get(digest) == block:  # type: ignore[arg-type]
                del cache[digest]  # type: ignore[arg-type]
            if self._events is not None:
                removed.setdefault(gid, []).append(digest)  # type: ignore[arg-type]
        self.epoch += 1
        if self._events is not None:
            for gid, digests in removed.items():
                self._events.append(BlockRemoved(group=gid, block_hashes=tuple(digests)))
        return victims

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (cached) block; revived free blocks leave the LRU."""
        refs = self.ref_counts
        evictable = self._evictable
        for block in blocks:
            if block:
                count = refs[block]
                if count == 0:
                    del evictable[block]
                refs[block] = count + 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free. Blocks freed
        earlier are evicted earlier. Refuses (changing nothing) if a count would go negative."""
        self.check_release(blocks)
        self._release_unchecked(blocks)

    def check_release(self, blocks: Sequence[int]) -> None:
        """Raise :class:`AllocatorError` if releasing ``blocks`` would corrupt the pool."""
        refs = self.ref_counts
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise AllocatorError(
                    f"block id {block} is not in this pool (ids 1..{self.num_blocks - 1})"
                )
            if block and refs[block] <= 0:
                raise AllocatorError(
                    f"block {block} has ref count {refs[block]}; releasing it again would make "
                    "it negative (double free)"
                )
        if len(set(blocks)) != len(blocks):
            counts: dict[int, int] = {}
            for block in blocks:
                if block:
                    counts[block] = counts.get(block, 0) + 1
            for block, times in counts.items():
                if times > refs[block]:
                    raise AllocatorError(
                        f"block {block} released {times} times but has ref count {refs[block]}"
                    )

    def _release_unchecked(self, blocks: Iterable[int]) -> None:
        refs = self.ref_counts
        block_hash = self._block_hash
        evictable = self._evictable
        fresh = self._fresh
        for block in blocks:
            if block:
                count = refs[block] - 1
                refs[block] = count
                if count == 0:
                    if block_hash[block] is None:
                        fresh.append(block)
                    else:
                        evictable[block] = None

    # ----------------------------------------------------------------- prefix cache
    def cache_blocks(self, gid: int, digests: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Make in-use ``blocks`` findable under ``digests`` for group ``gid``; a hash
        already cached keeps its block. Returns how many blocks were newly cached."""
        cache = self.caches[gid]
        block_hash = self._block_hash
        block_group = self._block_group
        stored = 0
        for digest, block in zip(digests, blocks):
            if block and block_hash[block] is None and cache.setdefault(digest, block) == block:
                block_hash[block] = digest
                block_group[block] = gid
                stored += 1
        return stored

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Blocks in use stay with their requests (uncached);
        free cached blocks become plain free blocks."""
        block_hash = self._block_hash
        for cache in self.caches.values():
            for block in cache.values():
                block_hash[block] = None
            cache.clear()
        if self._evictable:
            self._fresh.extend(self._evictable)
            self._evictable.clear()
        self.epoch += 1
        if self._events is not None:
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
            free_here = (block in fresh) + (block in self._evictable)
            if count == 0 and free_here != 1:
                raise AllocatorError(f"block {block} has ref count 0 but is free {free_here} times")
            if count > 0 and free_here:
                raise AllocatorError(f"block {block} is in use ({count}) and free")
            if block in fresh and self._block_hash[block] is not None:
                raise AllocatorError(f"uncached free block {block} still holds a cached prefix")
            if block in self._evictable and self._block_hash[block] is None:
                raise AllocatorError(f"evictable block {block} holds no cached prefix")
        for gid, cache in self.caches.items():
            for digest, block in cache.items():
                if self._block_hash[block] != digest or self._block_group[block] != gid:
                    raise AllocatorError(f"cache entry of group {gid} -> block {block} is stale")
