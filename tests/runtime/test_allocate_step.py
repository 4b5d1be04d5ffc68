"""``allocate_step`` is exactly ``allocate_slots`` called for each pair in order.

Random traces drive two identical allocators side by side, one through a loop of
``allocate_slots``, the other through ``allocate_step`` (steps of several requests, prefills
and decodes, admissions inside a step, repeated requests, lookahead, blocks running short):
every result, hit, block table and every field of every pool must stay equal.
"""

from __future__ import annotations

import re

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from runtime_testkit import admit_on_each, chunked, context, full, make_allocator, mamba, sliding

from kvspec_core import PluginManager
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.pool import EVICTION_POLICIES

CONFIGS = {
    "full": ([full(2)], 24, None),
    "full+sliding": ([full(2), sliding(2, 5)], 30, None),
    "full+mamba": ([full(4), mamba(4)], [20, 12], [0, 1]),
    "full+chunked": ([full(2), chunked(2, 6)], 30, None),
}
PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7], [])

admit_op = st.tuples(
    st.just("admit"),
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 2), max_size=12),
    st.integers(1, 8),
)
# Each entry: (index into the running requests, tokens to schedule, token to append first).
step_op = st.tuples(
    st.just("step"),
    st.lists(
        st.tuples(st.integers(0, 63), st.integers(0, 6), st.integers(-1, 2)), min_size=1, max_size=6
    ),
    st.integers(0, 2),
    st.booleans(),
)
finish_op = st.tuples(st.just("finish"), st.integers(0, 63))
programs = st.lists(st.one_of(admit_op, step_op, step_op, finish_op), max_size=40)


def pool_state(allocator: KVCacheAllocator) -> list[dict]:
    """Every field of every pool, the eviction orders as lists (an OrderedDict or, with the
    compiled kernels, a BlockQueue: either way in order); whether it was built with them aside."""
    return [
        {
            name: list(value) if name in ("_evictable", "_protected") else value
            for name, value in vars(pool).items()
            if name not in ("_events", "_compiled")
        }
        for pool in allocator.pools
    ]


def running_state(allocator: KVCacheAllocator) -> dict:
    """Every field of every running request's allocator-side state but the request."""
    return {
        rid: {name: getattr(state, name) for name in type(state).__slots__ if name != "request"}
        for rid, state in allocator._running.items()
    }


def assert_alike(first: KVCacheAllocator, second: KVCacheAllocator) -> None:
    """Both allocators hold the same block tables, running states and pools."""
    assert tables(first) == tables(second)
    assert running_state(first) == running_state(second)
    assert pool_state(first) == pool_state(second)


def finish_on_each(allocators: tuple[KVCacheAllocator, ...], running: list, index: int) -> None:
    """Free running pair ``index`` (modulo their number) on each allocator."""
    pair = running.pop(index % len(running))
    for allocator, request in zip(allocators, pair, strict=True):
        allocator.free(request.request_id)


def tables(allocator: KVCacheAllocator) -> dict:
    return {
        rid: (allocator.block_ids(rid), allocator.num_computed_tokens(rid))
        for rid in allocator._running
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    eviction=st.sampled_from(EVICTION_POLICIES),
    program=programs,
)
def test_allocate_step_equals_allocate_slots_in_order(
    config: str, eviction: str, program: list
) -> None:
    specs, blocks, pools = CONFIGS[config]
    one_by_one = make_allocator(specs, blocks, pools, eviction=eviction)
    batched = make_allocator(specs, blocks, pools, eviction=eviction)
    # Each side has its own Request objects (the allocator caches hashes on them).
    running: list[tuple[Request, Request]] = []
    next_id = 0
    for op in program:
        if op[0] == "admit":
            next_id = admit_on_each((one_by_one, batched), op, next_id, running)
        elif op[0] == "step":
            _, entries, lookahead, admit_new = op
            loop_steps, batch_steps = [], []
            for index, count, token in entries:
                if admit_new and index % 7 == 0:
                    # A request admitted inside the step, without a cached prefix.
                    prompt = [index % 3] * (count + 1)
                    pair = (Request(next_id, list(prompt)), Request(next_id, list(prompt)))
                    next_id += 1
                    running.append(pair)
                elif not running:
                    continue
                else:
                    pair = running[index % len(running)]
                if token >= 0:
                    for request in pair:
                        request.append_token(token)
                loop_steps.append((pair[0], count))
                # A bare Request stands for (request, 1).
                batch_steps.append(pair[1] if count == 1 and index % 2 else (pair[1], count))
            expected = []
            for request, count in loop_steps:
                try:
                    expected.append(one_by_one.allocate_slots(request, count, lookahead))
                except AllocatorError as error:
                    expected.append(("error", str(error)))
                    break
            try:
                got = batched.allocate_step(batch_steps, lookahead)
            except AllocatorError as error:
                got = expected[:-1] + [("error", str(error))]
            assert got == expected
        elif running:
            pair = running.pop(op[1] % len(running))
            if one_by_one.is_running(pair[0].request_id):
                one_by_one.free(pair[0].request_id)
                batched.free(pair[1].request_id)
        running = [pair for pair in running if one_by_one.is_running(pair[0].request_id)]
        assert tables(one_by_one) == tables(batched)
        assert pool_state(one_by_one) == pool_state(batched)
    batched.check_invariants()


def test_allocate_step_refuses_malformed_items_naming_the_index() -> None:
    allocator = make_allocator([full(2)], 16)
    first = Request(1, [1, 2, 3])
    with pytest.raises(
        AllocatorError, match=r"item 1 is 'oops', not a Request or a \(Request, int\) pair"
    ):
        allocator.allocate_step([(first, 3), "oops"])
    # The item before the malformed one was allocated, as in a loop of allocate_slots.
    assert allocator.num_computed_tokens(1) == 3
    with pytest.raises(AllocatorError, match="lookahead=-1 must be an int >= 0"):
        allocator.allocate_step([(first, 1)], lookahead=-1)
    with pytest.raises(AllocatorError, match=re.escape("num_new_tokens=1.5")):
        allocator.allocate_step([(first, 1.5)])
    assert allocator.num_computed_tokens(1) == 3


def test_allocate_step_returns_the_shared_no_new_blocks_result() -> None:
    allocator = make_allocator([full(4)], 16)
    requests = [Request(rid, [rid] * 5) for rid in range(3)]
    allocator.allocate_step([(request, 5) for request in requests])
    for request in requests:
        request.append_token(9)
    results = allocator.allocate_step([(request, 1) for request in requests])
    assert all(result is allocator.no_new_blocks for result in results)
    assert [allocator.num_computed_tokens(rid) for rid in range(3)] == [6, 6, 6]
    for request in requests:
        request.append_token(9)
    # Bare requests: one new token each.
    results = allocator.allocate_step(requests)
    assert all(result is allocator.no_new_blocks for result in results)
    assert [allocator.num_computed_tokens(rid) for rid in range(3)] == [7, 7, 7]


def test_allocate_step_calls_a_subclass_allocate_slots() -> None:
    calls: list[int] = []

    class Counting(KVCacheAllocator):
        def allocate_slots(self, request, num_new_tokens, lookahead=0, prefix=None):  # type: ignore[no-untyped-def]
            calls.append(num_new_tokens)
            return super().allocate_slots(request, num_new_tokens, lookahead, prefix)

    allocator = Counting([full(2)], 16, context(), manager=PluginManager())
    allocator.allocate_step([(Request(1, [1, 2, 3]), 3)])
    assert calls == [3]
