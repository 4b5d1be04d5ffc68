"""Regressions found in review: each test failed before its fix."""

from __future__ import annotations

import pytest
from runtime_testkit import full, make_allocator, sliding

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import (
    AllBlocksCleared,
    BlockPool,
    BlockStored,
    KVCacheAllocator,
    Request,
)


def _admit(allocator: KVCacheAllocator, request: Request):
    prefix = allocator.find_cached_prefix(request)
    return prefix, allocator.allocate_slots(
        request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
    )


def test_a_group_taking_blocks_never_evicts_another_groups_prefix_hit() -> None:
    # Two groups share one pool of 8 usable blocks. "a" (prompt P) is freed before "b"
    # (prompt Q), so a's blocks head the eviction order: group 0's, then group 1's. "c"
    # hits P in both groups and needs every free block; group 0's new blocks must come
    # from b's, never from the group-1 blocks c's own hit is about to reuse.
    allocator = make_allocator([full(4), full(4)], 9)
    shared = list(range(8))
    for rid, tokens in (("a", shared), ("b", list(range(100, 108)))):
        request = Request(rid, tokens)
        assert allocator.allocate_slots(request, len(tokens))
    allocator.free("a")
    allocator.free("b")
    request = Request("c", shared + list(range(200, 208)))
    prefix, result = _admit(allocator, request)
    assert prefix.num_tokens == 8 and result
    tables = allocator.block_ids("c")
    assert tables[0][:2] == prefix.block_ids[0] and tables[1][:2] == prefix.block_ids[1]
    assert not set(tables[0]) & set(tables[1]), tables
    pool = allocator.pools[0]
    for block in prefix.block_ids[0] + prefix.block_ids[1]:
        assert pool.ref_counts[block] == 1
        assert pool.cached_hash(block) is not None
    allocator.check_invariants()


@pytest.mark.parametrize("bad", [1.0, True, 0.5])
@pytest.mark.parametrize("argument", ["num_new_tokens", "lookahead"])
def test_a_running_request_refuses_non_int_counts_on_every_path(argument: str, bad) -> None:
    # A decode step that needs no new block takes the allocator's fast path; it must
    # refuse what the slow path refuses, not count 0.5 tokens as computed.
    allocator = make_allocator([full(4)], 16)
    request = Request("a", list(range(5)))
    assert allocator.allocate_slots(request, 5)
    before = allocator.num_computed_tokens("a"), allocator.block_ids("a"), allocator.usage
    counts = {"num_new_tokens": 1, "lookahead": 0, argument: bad}
    with pytest.raises(AllocatorError, match=argument):
        allocator.allocate_slots(request, counts["num_new_tokens"], counts["lookahead"])
    assert (allocator.num_computed_tokens("a"), allocator.block_ids("a"), allocator.usage) == before


def test_one_reset_of_a_multi_pool_allocator_is_one_cleared_event() -> None:
    allocator = make_allocator(
        [full(4), full(4)], [8, 8], pool_of_group=[0, 1], enable_kv_events=True
    )
    allocator.allocate_slots(Request("a", list(range(8))), 8)
    allocator.take_events()
    allocator.reset_prefix_cache()
    assert allocator.take_events() == [AllBlocksCleared()]


def test_stored_events_never_name_blocks_a_window_skipped_before_they_were_cached() -> None:
    # The step runs 6 tokens past the tokens the engine appended (drafts), so the window
    # skips sliding-window blocks 4 and 5 before their tokens are known; once the tokens
    # arrive those blocks hold nothing, and no event may say they entered the cache.
    allocator = make_allocator([full(2), sliding(2, 3)], 40, enable_kv_events=True)
    request = Request("a", list(range(8)))
    assert allocator.allocate_slots(request, 8)
    assert allocator.allocate_slots(request, 6)
    assert allocator.allocate_slots(request, 1)
    request.token_ids.extend(range(8, 15))
    allocator.take_events()
    assert allocator.allocate_slots(request, 0)
    cached = set(allocator._caches[1])
    stored = [
        digest
        for event in allocator.take_events()
        if isinstance(event, BlockStored) and event.group == 1
        for digest in event.block_hashes
    ]
    assert stored and set(stored) <= cached, "an event names a block that was never cached"
    allocator.check_invariants()


@pytest.mark.parametrize("bad", ["uncached free", "out of range"])
def test_touching_a_block_no_hit_can_name_is_refused_changing_nothing(bad: str) -> None:
    pool = BlockPool(6)
    cached, in_use = pool.take(2)
    pool.cache_blocks(0, [b"x" * 32], [cached])
    pool.release([cached])
    target = 5 if bad == "uncached free" else 6
    before = (list(pool.ref_counts), pool.num_free_blocks, pool.is_cached_free(cached))
    with pytest.raises(AllocatorError, match=f"block {target}"):
        pool.touch([cached, in_use, target])
    assert (list(pool.ref_counts), pool.num_free_blocks, pool.is_cached_free(cached)) == before
    pool.check_invariants()
