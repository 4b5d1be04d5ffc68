"""``KVCacheAllocator.discard_uncomputed``: a request whose forward failed leaves no false hit.

``allocate_slots`` caches a block once its tokens are known, before the engine writes its
K/V. When the engine's forward raises, the blocks past what it wrote must leave the prefix
cache (``free`` would keep them findable: a later request would hit garbage).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_testkit import context, full, make_allocator, mamba, sliding

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.events import BlockRemoved
from kvspec_core.specs.base import KVSpec

BLOCK = 4

SHAPES: dict[str, list[KVSpec]] = {
    "full": [full(BLOCK)],
    "full+sliding": [full(BLOCK), sliding(BLOCK, 6)],
    "full+mamba": [full(BLOCK), mamba(BLOCK)],
}


def allocator_of(shape: str, **options: object) -> KVCacheAllocator:
    """Whole prompts admitted in one step (in-flight tokens up to max_model_len)."""
    return make_allocator(SHAPES[shape], 128, ctx=context(64, 64), **options)


def admitted(allocator: KVCacheAllocator, rid: str, tokens: list[int]) -> Request:
    request = Request(rid, list(tokens))
    prefix = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
    return request


def hit_tokens(allocator: KVCacheAllocator, tokens: list[int]) -> int:
    return allocator.find_cached_prefix(Request("probe", list(tokens) + [7])).num_tokens


def snapshot(allocator: KVCacheAllocator) -> object:
    pools = [
        (
            list(pool.ref_counts),
            {gid: dict(cache) for gid, cache in pool.caches.items()},
            pool.epoch,
        )
        for pool in allocator.pools
    ]
    running = {
        rid: (allocator.block_ids(rid), allocator.num_computed_tokens(rid))
        for rid in allocator._running
    }
    return pools, running, list(allocator._freed)


def test_blocks_past_the_written_tokens_leave_the_cache_and_the_rest_stay() -> None:
    allocator = allocator_of("full")
    tokens = list(range(40))
    admitted(allocator, "a", tokens)
    assert hit_tokens(allocator, tokens) == 40  # free would leave all ten blocks findable
    allocator.discard_uncomputed("a", 18)  # the forward wrote 18 tokens, then raised
    assert hit_tokens(allocator, tokens) == 16  # blocks 0..3 hold tokens 0..15: still valid
    assert not allocator.is_running("a")
    with pytest.raises(AllocatorError, match="already freed"):
        allocator.free("a")
    allocator.check_invariants()
    # The discarded blocks are plain free blocks: a new request computes them again.
    admitted(allocator, "b", tokens)
    assert hit_tokens(allocator, tokens) == 40
    allocator.check_invariants()


@pytest.mark.parametrize("shape", list(SHAPES))
@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 48), data=st.data())
def test_no_lookup_ever_hits_past_the_written_tokens(
    shape: str, length: int, data: st.DataObject
) -> None:
    allocator = allocator_of(shape, enable_kv_events=True)
    shared = list(range(100, 100 + length))
    admitted(allocator, "first", shared[: data.draw(st.integers(0, length), "cached")] or [1])
    allocator.free("first")
    request = admitted(allocator, "a", shared)
    decoded = data.draw(st.integers(0, 8), "decoded")
    for token in range(decoded):
        request.append_token(200 + token)
        assert allocator.allocate_slots(request, 1)
    known = list(request.token_ids)
    valid = data.draw(st.integers(0, len(known)), "valid")
    allocator.take_events()
    allocator.discard_uncomputed("a", valid)
    allocator.check_invariants()
    assert hit_tokens(allocator, known) <= valid
    for event in allocator.take_events():
        assert isinstance(event, BlockRemoved)


def test_a_prefix_found_before_the_discard_is_stale() -> None:
    allocator = allocator_of("full")
    tokens = list(range(40))
    admitted(allocator, "a", tokens)
    later = Request("b", tokens + [1, 2])
    prefix = allocator.find_cached_prefix(later)
    assert prefix.num_tokens == 40  # a's blocks, in use
    allocator.discard_uncomputed("a", 8)
    result = allocator.allocate_slots(later, 2, prefix=prefix)
    assert not result and result.reason == "stale_prefix"
    allocator.check_invariants()


@pytest.mark.parametrize("bad", [-1, 41, True, 3.0, None])
def test_bad_counts_are_refused_changing_nothing(bad: object) -> None:
    allocator = allocator_of("full+sliding")
    admitted(allocator, "a", list(range(40)))
    before = snapshot(allocator)
    with pytest.raises(AllocatorError, match=r"num_valid_tokens=.* must be an int in \[0, 40\]"):
        allocator.discard_uncomputed("a", bad)  # type: ignore[arg-type]
    assert snapshot(allocator) == before


def test_unknown_and_freed_ids_are_refused() -> None:
    allocator = allocator_of("full")
    admitted(allocator, "a", list(range(10)))
    allocator.free("a")
    with pytest.raises(AllocatorError, match="already freed"):
        allocator.discard_uncomputed("a", 0)
    with pytest.raises(AllocatorError, match="never allocated"):
        allocator.discard_uncomputed("zz", 0)
