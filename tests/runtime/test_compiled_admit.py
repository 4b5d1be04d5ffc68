"""The compiled admission (``admit.c``) admits as the Python method does.

Random programs look prefixes up, then admit requests with their own prefix, no prefix,
another request's prefix, a prefix gone stale, a lookahead or more tokens than
``max_model_len``; grow, free, and re-admit freed requests, on full attention, sliding window
+ full attention, Mamba + full attention and two pools, in roomy and tight pools with caching
on and off. One allocator runs on the kernels and one on the pure-Python code: every answer,
error, hit, block table, running state and pool field must stay equal.
"""

from __future__ import annotations

import functools
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from runtime_testkit import context, full, make_allocator, mamba, manager_with_families, sliding
from test_allocate_step import assert_alike
from test_dense_path import grow_on_each, outcome
from test_native_kernels import OnPurePython, pure_python

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import EVICTION_POLICIES

pytestmark = [
    pytest.mark.both_kernels,
    pytest.mark.skipif(native is None, reason="kvspec_core.runtime._native is not built"),
]

CONFIGS: dict[str, tuple[list, Any, Any]] = {
    "full attention": ([full(2)], None, None),
    "sliding window + full, one pool": ([full(2), sliding(2, 5)], None, None),
    "mamba + full, one pool": ([full(2), mamba(2)], None, None),
    "two pools": ([full(2), full(2)], None, [0, 1]),
}
PROMPTS = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7], [5])

# A new pending request (its prefix looked up now): prompt, extra tokens.
new_op = st.tuples(
    st.just("new"), st.sampled_from(PROMPTS), st.lists(st.integers(0, 1), max_size=8)
)
# Admit pending request ``index`` with: its prefix looked up now ("fresh"), the one looked up
# when it was queued ("stored", perhaps stale), none, another pending request's; tokens to
# schedule past the hit (-1: the rest of the prompt, -2: one draft token more, -3: up to the
# Mamba checkpoint if one is named, 99: over max_model_len); lookahead.
admit_op = st.tuples(
    st.just("admit"),
    st.integers(0, 7),
    st.sampled_from(["fresh", "fresh", "fresh", "stored", "none", "other"]),
    st.sampled_from([-1, -1, -1, -2, -3, 0, 1, 3, 99]),
    st.sampled_from([0, 0, 1, 4]),
)
grow_op = st.tuples(
    st.just("grow"), st.integers(0, 63), st.integers(0, 6), st.integers(0, 3), st.integers(-1, 2)
)
# Free running request ``index``; with True, it is queued again (preempted) with its tokens.
free_op = st.tuples(st.just("free"), st.integers(0, 63), st.booleans())
programs = st.lists(
    st.one_of(new_op, admit_op, admit_op, grow_op, free_op), min_size=10, max_size=60
)


def look_up(sides: tuple, pair: tuple[Request, Request]) -> list[Any]:
    prefixes = [
        outcome(lambda s=side, r=request: s.find_cached_prefix(r))
        for side, request in zip(sides, pair, strict=True)
    ]
    assert prefixes[0] == prefixes[1]
    return prefixes


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    blocks=st.sampled_from([6, 12, 24, 24, 120]),
    eviction=st.sampled_from(EVICTION_POLICIES),
    caching=st.sampled_from([True, True, False]),
    program=programs,
)
def test_compiled_admissions_equal_the_python_ones(
    config: str, blocks: int, eviction: str, caching: bool, program: list
) -> None:
    specs, _, pools = CONFIGS[config]
    sizes = blocks if pools is None else [blocks, blocks]
    options = dict(eviction=eviction, enable_prefix_caching=caching)
    compiled = make_allocator(specs, sizes, pools, **options)
    with pure_python():
        reference = OnPurePython(make_allocator(specs, sizes, pools, **options))
    assert compiled._compiled_admission(compiled._compiled_group_step())[0] is compiled._freed
    sides = (compiled, reference)
    # Pending: (request per side, prefix per side or None); running: a request per side.
    pending: list[tuple[tuple[Request, Request], list[Any]]] = []
    running: list[tuple[Request, Request]] = []
    next_id = 0
    for op in program:
        if op[0] == "new":
            prompt = [*op[1], *op[2]]
            pair = (Request(next_id, list(prompt)), Request(next_id, list(prompt)))
            next_id += 1
            pending.append((pair, look_up(sides, pair)))
        elif op[0] == "admit" and pending:
            _, index, which, count, lookahead = op
            entry = pending[index % len(pending)]
            pair, prefixes = entry
            if which == "fresh":
                prefixes = look_up(sides, pair)
            elif which == "other":
                prefixes = pending[(index + 1) % len(pending)][1]
            hit = prefixes[0].num_tokens if which != "none" else 0
            length = len(pair[0].token_ids)
            if count in (-1, -2):
                count = length - hit - 1 - count
            elif count == -3:
                count = (prefixes[0].checkpoint_at or length) - hit
            # Each call runs at once (outcome): the defaults bind this iteration's values.
            results = [
                outcome(
                    lambda s=side, r=request, p=prefix, n=count, ahead=lookahead, w=which: (
                        s.allocate_slots(r, n, ahead, prefix=None if w == "none" else p)
                    )
                )
                for side, request, prefix in zip(sides, pair, prefixes, strict=True)
            ]
            assert results[0] == results[1]
            if results[0] and not isinstance(results[0], tuple):  # Allocated, not an error
                pending.remove(entry)
                running.append(pair)
        elif op[0] == "grow" and running:
            _, index, count, lookahead, token = op
            grow_on_each(sides, running[index % len(running)], count, lookahead, token)
        elif op[0] == "free" and running:
            pair = running.pop(op[1] % len(running))
            for side, request in zip(sides, pair, strict=True):
                side.free(request.request_id)
            if op[2]:
                # Preempted: its tokens so far come back as a prompt (same id: a re-admission).
                pending.append((pair, look_up(sides, pair)))
        assert_alike(compiled, reference._allocator)
    compiled.check_invariants()
    reference.check_invariants()


@pytest.mark.parametrize("specs", [[full(2)], [full(2), sliding(2, 5)], [full(2), mamba(2)]])
def test_admissions_run_compiled(specs: list) -> None:
    allocator = make_allocator(specs, 48)

    def python_admission(*args: Any) -> Any:
        raise AssertionError("admitted by the Python method")

    # The Python path looks the method up on the instance; the compiled admission does not.
    allocator._admit_checked = python_admission  # type: ignore[method-assign]
    first = Request("a", [1, 2, 3, 4, 5])
    assert allocator.allocate_slots(first, 5, prefix=allocator.find_cached_prefix(first))
    second = Request("b", [1, 2, 3, 4, 9, 9, 9])
    hit = allocator.find_cached_prefix(second)
    # Mamba saved no state at 4 (a's prefill ended at 5): it names the checkpoint instead.
    assert hit.num_tokens == (0 if hit.checkpoint_at else 4)
    assert allocator.allocate_slots(second, 7 - hit.num_tokens, 1, hit)
    assert allocator.allocate_slots(Request("c", [8, 8, 8]), 3)
    shared = allocator.block_ids("b")[0][:2] == allocator.block_ids("a")[0][:2]
    assert shared == (hit.num_tokens == 4)
    # What it leaves to the method: a request freed before, asked again without a prefix.
    allocator.free("c")
    with pytest.raises(AssertionError, match="Python method"):
        allocator.allocate_slots(Request("c", [8, 8, 8]), 3)
    allocator.check_invariants()


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_allocator([full(2)], 24, enable_kv_events=True),
        lambda: make_allocator([full(4)], 24, hash_block_size=2),
        # A subclass that changes how admissions are made admits through its Python code.
        lambda: type(
            "Custom",
            (KVCacheAllocator,),
            {
                "_cache_new_blocks": lambda self, *args: KVCacheAllocator._cache_new_blocks(
                    self, *args
                ),
            },
        )([full(2)], 24, context(), manager=manager_with_families()),
    ],
)
def test_admissions_run_as_python_where_the_kernel_does_not_apply(make: Any) -> None:
    allocator = make()
    assert allocator._compiled_admission(allocator._compiled_group_step()) is None
    calls: list[int] = []
    method = allocator._admit_checked

    def spy(*args: Any) -> Any:
        calls.append(1)
        return method(*args)

    allocator._admit_checked = spy  # type: ignore[method-assign]
    request = Request("a", [1, 2, 3, 4, 5])
    assert allocator.allocate_slots(request, 5, prefix=allocator.find_cached_prefix(request))
    assert calls == [1]


def test_a_hit_on_cached_free_blocks_counts_them_against_the_free_blocks() -> None:
    sides = [make_allocator([full(2)], 6)]
    with pure_python():
        sides.append(OnPurePython(make_allocator([full(2)], 6)))
    answers = []
    for side in sides:
        first = Request("a", [1, 2, 3, 1, 2, 3, 1, 2, 3, 4])
        assert side.allocate_slots(first, 10, prefix=side.find_cached_prefix(first))
        side.free("a")  # its 5 blocks: cached, free, the whole pool
        second = Request("b", [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 0, 0])
        hit = side.find_cached_prefix(second)
        assert hit.num_tokens == 10
        # One new block, but reviving the 5 hit blocks leaves none free: not now.
        answers.append(side.allocate_slots(second, 2, prefix=hit))
        assert not answers[-1] and answers[-1].blocks_needed == 6
        assert side.allocate_slots(second, 0, prefix=hit)
    assert answers[0] == answers[1]
    assert_alike(sides[0], sides[1]._allocator)


def test_prefix_lookups_of_one_full_attention_group_run_compiled() -> None:
    allocator = make_allocator([full(2)], 24)
    looked_up: list[Any] = []
    method = allocator._find_cached_prefix

    def spy(request: Request) -> Any:
        looked_up.append(request.request_id)
        return method(request)

    # The compiled lookup calls the method it was built with for what it leaves to Python.
    assert allocator.find_cached_prefix.args[1] == allocator._find_cached_prefix  # type: ignore[attr-defined]
    allocator.find_cached_prefix = functools.partial(  # type: ignore[method-assign]
        native.find_prefix,
        allocator.find_cached_prefix.args[0],  # type: ignore[attr-defined]
        spy,
    )
    first = Request("a", [1, 2, 3, 4, 5], cache_salt="tenant")
    assert allocator.allocate_slots(first, 5, prefix=allocator.find_cached_prefix(first))
    second = Request("b", [1, 2, 3, 4, 9], cache_salt="tenant")
    with pure_python():
        reference = make_allocator([full(2)], 24)
        reference.allocate_slots(Request("a", [1, 2, 3, 4, 5], cache_salt="tenant"), 5)
        expected = reference.find_cached_prefix(Request("b", [1, 2, 3, 4, 9], cache_salt="tenant"))
    assert allocator.find_cached_prefix(second) == expected
    assert expected.num_tokens == 4 and expected.block_ids == (allocator.block_ids("a")[0][:2],)
    assert looked_up == []
    # Left to the method: a running request (refused), a prompt too short to look up, an id
    # that is no str or int (refused). A token that cannot be hashed the kernel refuses
    # itself, with the method's error.
    with pytest.raises(AllocatorError, match="already running"):
        allocator.find_cached_prefix(first)
    assert allocator.find_cached_prefix(Request("c", [1, 2])).num_tokens == 0
    with pytest.raises(AllocatorError, match="must be a str or an int"):
        allocator.find_cached_prefix(Request(2.5, [1, 2, 3, 4]))  # type: ignore[arg-type]
    with pytest.raises(
        AllocatorError, match=r"request 'd': token ids in \[0, 2\) .* token 1 is -2"
    ):
        allocator.find_cached_prefix(Request("d", [1, -2, 3, 4]))
    assert looked_up == ["a", "c", 2.5]


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_allocator([full(2)], 24, enable_prefix_caching=False),
        lambda: make_allocator([full(2), sliding(2, 5)], 40),
        lambda: make_allocator([full(4)], 24, hash_block_size=2),
    ],
)
def test_prefix_lookups_run_as_python_where_the_kernel_does_not_apply(make: Any) -> None:
    allocator = make()
    assert not isinstance(allocator.find_cached_prefix, functools.partial)
