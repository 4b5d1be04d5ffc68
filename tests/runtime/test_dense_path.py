"""The short paths for full-attention-only allocators change nothing but speed.

An allocator whose groups all follow the core's full-attention rules grows requests through
``_grow_dense`` and its pools hand out evicted blocks in one pass; with KV events on, the same
allocator takes the general paths (``_grow_checked``, ``BlockPool._evict``). Random programs
drive both side by side: every result, error, hit, block table and every pool field must
stay equal.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from runtime_testkit import admit_on_each, full, make_allocator, sliding
from test_allocate_step import assert_alike, finish_on_each

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.pool import EVICTION_POLICIES

CONFIGS = {
    "one group": ([full(2)], 24, None),
    "two block sizes, one pool": ([full(2), full(4)], 40, None),
    "two pools": ([full(2), full(4)], [16, 12], [0, 1]),
}
PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7], [])

admit_op = st.tuples(
    st.just("admit"),
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 2), max_size=12),
    st.integers(1, 8),
)
# (running request index, tokens to schedule, lookahead, token to append first; -1: none,
# -2: a token that cannot be hashed).
grow_op = st.tuples(
    st.just("grow"), st.integers(0, 63), st.integers(0, 6), st.integers(0, 3), st.integers(-2, 2)
)
finish_op = st.tuples(st.just("finish"), st.integers(0, 63))
programs = st.lists(st.one_of(admit_op, grow_op, grow_op, grow_op, finish_op), max_size=60)


def outcome(call):  # type: ignore[no-untyped-def]
    try:
        return call()
    except AllocatorError as error:
        return ("error", str(error))


def grow_on_each(allocators, pair, count, lookahead, token):  # type: ignore[no-untyped-def]
    """Append ``token`` to each side's request of ``pair`` (-1: none; -2: one that cannot be
    hashed), then ``allocate_slots(request, count, lookahead)`` on each: the same answer."""
    if token != -1:
        for request in pair:
            request.append_token(-5 if token == -2 else token)
    results = [
        outcome(lambda a=allocator, r=request: a.allocate_slots(r, count, lookahead))
        for allocator, request in zip(allocators, pair, strict=True)
    ]
    assert results[0] == results[1]
    if token == -2:
        # Refused (nothing changed); take the bad token back on both sides.
        for request in pair:
            request.token_ids.pop()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    eviction=st.sampled_from(EVICTION_POLICIES),
    program=programs,
)
def test_dense_paths_equal_the_general_ones(config: str, eviction: str, program: list) -> None:
    specs, blocks, pools = CONFIGS[config]
    dense = make_allocator(specs, blocks, pools, eviction=eviction)
    general = make_allocator(specs, blocks, pools, eviction=eviction, enable_kv_events=True)
    assert dense._dense and not general._dense
    run_on_both((dense, general), program)


def run_on_both(allocators: tuple[KVCacheAllocator, KVCacheAllocator], program: list) -> None:
    """Carry out ``program`` (ops of ``programs``) on both allocators, which must stay alike
    after every op."""
    running: list[tuple[Request, Request]] = []
    next_id = 0
    for op in program:
        if op[0] == "admit":
            next_id = admit_on_each(allocators, op, next_id, running)
        elif op[0] == "grow" and running:
            _, index, count, lookahead, token = op
            grow_on_each(allocators, running[index % len(running)], count, lookahead, token)
        elif op[0] == "finish" and running:
            finish_on_each(allocators, running, op[1])
        assert_alike(*allocators)
    for allocator in allocators:
        allocator.check_invariants()


def test_sliding_window_and_plugin_rules_take_the_general_path() -> None:
    assert not make_allocator([full(2), sliding(2, 5)], 30)._dense


def test_a_prefix_naming_blocks_this_pool_does_not_cache_is_refused() -> None:
    # Found by another allocator (same epochs, 0): its blocks are not cached here (under
    # this request's hashes), so it is not a prefix this allocator handed out.
    other = make_allocator([full(2)], 24)
    donor = Request("d", [1, 2, 3, 4, 5])
    assert other.allocate_slots(donor, 5, prefix=other.find_cached_prefix(donor))
    request = Request("r", [1, 2, 3, 4, 5, 6])
    foreign = other.find_cached_prefix(request)
    assert foreign.num_tokens == 4
    for allocator in (
        make_allocator([full(2)], 24),
        make_allocator([full(2)], 24, enable_kv_events=True),
    ):
        fresh_blocks = allocator.pools[0].num_free_blocks
        with pytest.raises(AllocatorError, match="not one this allocator handed out"):
            allocator.allocate_slots(Request("r", [1, 2, 3, 4, 5, 6]), 2, prefix=foreign)
        assert not allocator.is_running("r")
        assert allocator.pools[0].num_free_blocks == fresh_blocks
        allocator.check_invariants()


def test_a_preempted_request_resumes_below_its_last_token_on_both_paths() -> None:
    for allocator in (
        make_allocator([full(2)], 24),
        make_allocator([full(2)], 24, enable_kv_events=True),
    ):
        request = Request("r", [1, 2, 3, 4, 5, 6])
        assert allocator.allocate_slots(request, 6, prefix=allocator.find_cached_prefix(request))
        allocator.free("r")  # preempted: all its blocks stay cached, its hashes on it
        assert len(request.block_hashes) == 3
        prefix = allocator.find_cached_prefix(request)
        # The last token is always computed again, to produce logits.
        assert prefix.num_tokens == 4 and len(prefix.block_ids[0]) == 2
