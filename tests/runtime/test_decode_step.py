"""``decode_step(ids, tokens)`` is exactly ``request.token_ids.append(token);
allocate_slots(request, 1)`` for each running request, in order (a refused step's token is
taken back off its list).

Random traces drive two identical allocators side by side, one through that loop, the other
through ``decode_step`` (several requests per step, repeated ones, lookahead, blocks running
short, tokens that cannot be hashed, ids that name no running request): every result and
error, every token list, block table, running state and pool field must stay equal.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from runtime_testkit import admit_on_each, full, make_allocator, mamba, sliding
from test_allocate_step import assert_alike, finish_on_each

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import Request
from kvspec_core.runtime.pool import EVICTION_POLICIES

CONFIGS = {
    "full": ([full(2)], 24, None),
    "full, tight pool": ([full(2)], 10, None),
    "full+sliding": ([full(2), sliding(2, 5)], 30, None),
    "full+mamba": ([full(4), mamba(4)], [20, 12], [0, 1]),
}
PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7], [])

admit_op = st.tuples(
    st.just("admit"),
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 2), max_size=12),
    st.integers(1, 8),
)


class Unhashable:
    """A sampled token of an integer type (it has ``__index__``) whose value cannot be
    hashed: accepted by decode_step, refused once its block fills."""

    def __index__(self) -> int:
        return -5

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unhashable)

    __hash__ = object.__hash__


UNHASHABLE = Unhashable()
# Entries: (index into the running requests, or -1 for an id that is not running; the
# sampled token, UNHASHABLE cannot be hashed); the step's lookahead.
decode_op = st.tuples(
    st.just("decode"),
    st.lists(
        st.tuples(st.integers(-1, 63), st.sampled_from([0, 1, 2, 2, 2, UNHASHABLE])),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([0, 0, 0, 2]),
)
finish_op = st.tuples(st.just("finish"), st.integers(0, 63))
programs = st.lists(st.one_of(admit_op, decode_op, decode_op, decode_op, finish_op), max_size=50)


def loop_of_slots(allocator, requests, tokens, lookahead):  # type: ignore[no-untyped-def]
    """What decode_step stands for, with the error it raises at the first bad item."""
    results = []
    for request, token in zip(requests, tokens, strict=True):
        if request is None or not allocator.is_running(request.request_id):
            return results, "not running"
        request.token_ids.append(token)
        try:
            results.append(allocator.allocate_slots(request, 1, lookahead))
        except AllocatorError as error:
            request.token_ids.pop()  # decode_step takes a refused step's token back
            return results, str(error)
    return results, None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    eviction=st.sampled_from(EVICTION_POLICIES),
    program=programs,
)
def test_decode_step_equals_appending_and_allocating_in_order(
    config: str, eviction: str, program: list
) -> None:
    specs, blocks, pools = CONFIGS[config]
    one_by_one = make_allocator(specs, blocks, pools, eviction=eviction)
    batched = make_allocator(specs, blocks, pools, eviction=eviction)
    running: list[tuple[Request, Request]] = []
    next_id = 0
    for op in program:
        if op[0] == "admit":
            next_id = admit_on_each((one_by_one, batched), op, next_id, running)
        elif op[0] == "decode" and running:
            _, entries, lookahead = op
            pairs = [None if index < 0 else running[index % len(running)] for index, _ in entries]
            tokens = [token for _, token in entries]
            expected, error = loop_of_slots(
                one_by_one, [pair and pair[0] for pair in pairs], tokens, lookahead
            )
            ids = [pair[1].request_id if pair else "nobody" for pair in pairs]
            try:
                got = batched.decode_step(ids, tokens, lookahead)
                assert error is None
                assert got == expected
            except AllocatorError as raised:
                if error == "not running":
                    assert "is unknown to this allocator" in str(raised)
                    assert f"the {len(expected)} requests before it were stepped" in str(raised)
                else:
                    assert error is not None and str(raised).endswith(
                        f"{error}; the {len(expected)} items before it were stepped"
                    )
            for pair in pairs:
                if pair and pair[0].token_ids[-1:] == [UNHASHABLE]:
                    # A token that cannot be hashed, accepted while its block was not full:
                    # drop it on both sides, or every later step of the request is refused.
                    for request in pair:
                        request.token_ids.pop()
            assert [pair[0].token_ids for pair in running] == [
                pair[1].token_ids for pair in running
            ]
        elif op[0] == "finish" and running:
            finish_on_each((one_by_one, batched), running, op[1])
        assert_alike(one_by_one, batched)
    batched.check_invariants()


def test_decode_step_refuses_mismatched_lists_and_ids_it_does_not_run() -> None:
    allocator = make_allocator([full(2)], 16)
    first, second = Request(1, [1, 2, 3]), Request(2, [4, 5, 6])
    for request in (first, second):
        assert allocator.allocate_slots(request, 3, prefix=allocator.find_cached_prefix(request))
    with pytest.raises(AllocatorError, match="2 request ids but 1 tokens"):
        allocator.decode_step([1, 2], [7])
    assert first.token_ids == [1, 2, 3]
    with pytest.raises(AllocatorError, match="lookahead=-1 must be an int >= 0"):
        allocator.decode_step([1], [7], lookahead=-1)
    allocator.free(2)
    with pytest.raises(
        AllocatorError,
        match=r"item 1: request 2 was already freed .*the 1 "
        "requests before it were stepped",
    ):
        allocator.decode_step((1, 2), (7, 8))
    assert first.token_ids == [1, 2, 3, 7] and second.token_ids == [4, 5, 6]
    assert allocator.num_computed_tokens(1) == 4
    with pytest.raises(
        AllocatorError, match=r"item 0: request_id=<a list> must be a str or an int"
    ):
        allocator.decode_step([[1]], [7])
    # Any iterables: they are read once, into tuples.
    results = allocator.decode_step(iter([1]), iter([9]))
    assert results[0].new_block_ids == ((3,),)
    assert first.token_ids == [1, 2, 3, 7, 9]


def test_decode_step_appends_to_a_request_subclass_through_its_own_list() -> None:
    class Tracked(Request):
        __slots__ = ("log",)

    allocator = make_allocator([full(2)], 16)
    request = Tracked(1, [1, 2, 3])
    assert allocator.allocate_slots(request, 3, prefix=allocator.find_cached_prefix(request))
    assert allocator.decode_step([1], [4]) == [allocator.no_new_blocks]
    assert allocator.decode_step([1], [5])[0].new_block_ids == ((3,),)
    assert request.token_ids == [1, 2, 3, 4, 5]
    assert allocator.num_computed_tokens(1) == 5


def test_a_refused_step_takes_its_token_back_and_changes_nothing() -> None:
    sides = (make_allocator([full(2)], 16), make_allocator([full(2)], 16))
    pairs = [
        (Request(1, [1, 2, 3]), Request(1, [1, 2, 3])),
        (Request(2, [4, 5, 6]), Request(2, [4, 5, 6])),
    ]
    for pair in pairs:
        for side, request in zip(sides, pair, strict=True):
            assert side.allocate_slots(request, 3, prefix=side.find_cached_prefix(request))

    class Negative:
        """An integer type (it has ``__index__``) whose value cannot be hashed."""

        def __index__(self) -> int:
            return -5

    # Request 2's token completes its second block, which cannot be hashed with it (only
    # then is its value read); the error names the item.
    with pytest.raises(AllocatorError, match=r"decode_step: item 1 \(request 2\): .*token 3 is"):
        sides[0].decode_step([1, 2, 1], [7, Negative(), 8])
    sides[1].decode_step([1], [7])  # what happened: request 1 stepped, nothing else
    assert (
        [pair[0].token_ids for pair in pairs]
        == [pair[1].token_ids for pair in pairs]
        == [[1, 2, 3, 7], [4, 5, 6]]
    )
    assert_alike(*sides)
    sides[0].check_invariants()


@pytest.mark.parametrize("bad", [-7, 2**32, "x", 1.5, None, True])
def test_a_sampled_token_that_can_never_be_hashed_is_refused_before_any_step(
    bad: object,
) -> None:
    # Found by review: such a token was appended, and refused only once its block filled,
    # steps later; every later decode_step then stopped at its request.
    allocator = make_allocator([full(4)], 32)
    requests = [Request(rid, [1, 2, 3]) for rid in range(3)]
    for request in requests:
        assert allocator.allocate_slots(request, 3)
    with pytest.raises(AllocatorError, match=r"decode_step: item 1 \(request 1\): the sampled"):
        allocator.decode_step([0, 1, 2], [9, bad, 9])  # type: ignore[list-item]
    assert [request.token_ids for request in requests] == [[1, 2, 3]] * 3
    assert [allocator.num_computed_tokens(rid) for rid in range(3)] == [3, 3, 3]
