"""The block pool: null block, LRU and segmented eviction, ref-count guards, reset."""

from __future__ import annotations

import pytest
from runtime_testkit import full, make_allocator

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import AllBlocksCleared, BlockPool, BlockRemoved, Request


def digest(index: int) -> bytes:
    return index.to_bytes(32, "little")


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    blocks = pool.take(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4
    with pytest.raises(AllocatorError, match="only 0 are free"):
        pool.take(1)


@pytest.mark.parametrize("size", [0, 1, -3, True, 2.0])
def test_refuses_pools_without_a_usable_block(size: object) -> None:
    with pytest.raises(AllocatorError, match="num_blocks"):
        BlockPool(size)  # type: ignore[arg-type]


def test_refuses_unknown_eviction_policy() -> None:
    with pytest.raises(AllocatorError, match="eviction='mru'"):
        BlockPool(4, eviction="mru")


def cached_pool(eviction: str) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(5, eviction=eviction)
    blocks = pool.take(4)
    pool.cache_blocks(0, [digest(i) for i in range(4)], blocks)
    return pool, blocks


def test_lru_evicts_least_recently_freed_first() -> None:
    pool, blocks = cached_pool("lru")
    pool.release([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.num_cached_blocks == 4
    assert pool.take(2) == [blocks[2], blocks[0]]
    assert pool.caches[0] == {digest(3): blocks[3], digest(1): blocks[1]}


def test_uncached_free_blocks_go_before_any_cached_one() -> None:
    pool = BlockPool(4, eviction="lru")
    first, second, _third = pool.take(3)
    pool.cache_blocks(0, [digest(1)], [first])
    pool.release([first, second])
    assert pool.take(1) == [second]
    assert pool.caches[0] == {digest(1): first}


def test_segmented_evicts_reused_blocks_last() -> None:
    pool, blocks = cached_pool("segmented")
    pool.touch([blocks[0]])  # a prefix hit reused block 0
    pool.release([blocks[0], blocks[0], blocks[1], blocks[2], blocks[3]])
    assert pool.take(3) == [blocks[1], blocks[2], blocks[3]]
    assert pool.caches[0] == {digest(0): blocks[0]}
    assert pool.take(1) == [blocks[0]]


def test_touch_revives_a_cached_free_block() -> None:
    pool, blocks = cached_pool("lru")
    pool.release(blocks)
    pool.touch([blocks[1]])
    assert pool.ref_counts[blocks[1]] == 1 and not pool.is_cached_free(blocks[1])
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def snapshot(pool: BlockPool) -> tuple:
    return (list(pool.ref_counts), pool.num_free_blocks, dict(pool.caches[0]))


def test_double_release_is_refused_and_changes_nothing() -> None:
    pool, blocks = cached_pool("lru")
    pool.release([blocks[0]])
    before = snapshot(pool)
    with pytest.raises(AllocatorError, match="negative"):
        pool.release([blocks[1], blocks[0]])
    assert snapshot(pool) == before
    pool.check_invariants()


def test_release_of_duplicates_beyond_the_count_is_refused() -> None:
    pool, blocks = cached_pool("lru")
    before = snapshot(pool)
    with pytest.raises(AllocatorError, match="released 2 times"):
        pool.release([blocks[0], blocks[0]])
    assert snapshot(pool) == before


def test_release_of_a_block_outside_the_pool_is_refused() -> None:
    pool, _ = cached_pool("lru")
    with pytest.raises(AllocatorError, match="not in this pool"):
        pool.release([7])


def test_reset_forgets_every_prefix_and_frees_cached_blocks() -> None:
    events: list = []
    pool = BlockPool(5, events=events)
    blocks = pool.take(4)
    pool.cache_blocks(0, [digest(i) for i in range(4)], blocks)
    pool.release(blocks[2:])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 2
    assert events == [AllBlocksCleared()]
    pool.release(blocks[:2])
    pool.check_invariants()
    assert pool.num_free_blocks == 4


def test_eviction_reports_removed_hashes_per_group() -> None:
    events: list = []
    pool = BlockPool(3, group_ids=(0, 1), events=events)
    first, second = pool.take(2)
    pool.cache_blocks(0, [digest(1)], [first])
    pool.cache_blocks(1, [digest(1)], [second])
    pool.release([first, second])
    pool.take(2)
    assert events == [
        BlockRemoved(group=0, block_hashes=(digest(1),)),
        BlockRemoved(group=1, block_hashes=(digest(1),)),
    ]


def test_a_hash_cached_again_moves_to_the_newer_copy() -> None:
    # A request computed a cached block again: the hash lives as long as the newest copy
    # (as in vLLM, which keeps every copy); the old copy leaves the cache.
    pool = BlockPool(4)
    first, second = pool.take(2)
    assert pool.cache_blocks(0, [digest(5)], [first]) == 1
    pool.release([first])
    assert pool.cache_blocks(0, [digest(5)], [second]) == 1
    assert pool.caches[0] == {digest(5): second}
    assert pool.cached_hash(first) is None and not pool.is_cached_free(first)
    assert pool.take(1) == [first]  # uncached now, so reused before any cached block
    pool.check_invariants()


def refuse(groups: list[int], hashes: list[bytes], victims: list[int]) -> None:
    raise RuntimeError("offload tier refused")


@pytest.mark.parametrize("eviction", ["lru", "segmented"])
def test_a_take_whose_eviction_hook_raises_loses_no_block(eviction: str) -> None:
    # Found by review: the taken blocks (uncached ones and the evicted victims) kept ref
    # count 1 with no owner, lost to the pool for good.
    pool = BlockPool(7, eviction=eviction)
    blocks = pool.take(6)
    pool.cache_blocks(0, [digest(i) for i in range(6)], blocks)
    if eviction == "segmented":
        pool.touch(blocks[:2])  # reused: evicted through the general path
        pool.release(blocks[:2])
    pool.release(blocks[:4])
    pool.release(pool.take(1))  # one uncached free block too
    pool._on_evict = refuse
    free = pool.num_free_blocks
    with pytest.raises(RuntimeError, match="offload tier refused"):
        pool.take(3)
    assert pool.num_free_blocks == free
    pool.check_invariants()
    pool._on_evict = None
    assert len(pool.take(free)) == free


def test_cache_blocks_with_a_bad_id_caches_nothing() -> None:
    # Found by review: the pairs before the bad id stayed cached (and the pure-Python twin
    # cached a hash under block -1).
    for bad, error in ((99, IndexError), (-1, IndexError), (True, TypeError), (2.0, TypeError)):
        pool = BlockPool(8)
        blocks = pool.take(3)
        with pytest.raises(error, match="block id"):
            pool.cache_blocks(0, [digest(0), digest(1)], [blocks[0], bad])  # type: ignore[list-item]
        assert pool.num_cached_blocks == 0 and pool.cached_hash(blocks[0]) is None
        pool.check_invariants()


def test_a_step_whose_eviction_hook_raises_loses_no_block() -> None:
    # The same through the allocator's steps, whose compiled kernels take blocks without
    # BlockPool.take (pool_access.c).
    allocator = make_allocator([full(2)], 8)
    pool = allocator.pools[0]
    for number in range(3):
        request = Request(f"old{number}", [number * 10 + t for t in range(4)])
        assert allocator.allocate_slots(request, 4, prefix=allocator.find_cached_prefix(request))
        allocator.free(request.request_id)
    request = Request("new", [99, 98, 97])
    assert allocator.allocate_slots(request, 3, prefix=allocator.find_cached_prefix(request))
    pool._on_evict = refuse
    free = pool.num_free_blocks
    assert pool.num_cached_blocks and not len(pool._fresh)
    request.append_token(96)
    request.append_token(95)  # a new block: a cached one is evicted for it
    with pytest.raises(RuntimeError, match="offload tier refused"):
        allocator.allocate_slots(request, 2)
    assert pool.num_free_blocks == free
    pool.check_invariants()
