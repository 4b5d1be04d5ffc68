"""The compiled kernels (``kvspec_core.runtime._native``) compute what the Python code does.

BLAKE2b and the chained block hashes are compared with hashlib and the pure-Python hasher
byte for byte; random programs drive one allocator on the kernels and one on the pure-Python
code side by side, and every result, error, hit, block table and pool field must stay equal
(full attention, sliding window, Mamba, two pools, both eviction orders, KV events on and off).
The rest of the runtime suite runs once per implementation (see ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import hashlib
import operator
import pickle
import re
import struct
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from runtime_testkit import (
    admit_on_each,
    context,
    full,
    make_allocator,
    mamba,
    manager_with_families,
    sliding,
    use_pure_python,
)
from test_allocate_step import assert_alike, finish_on_each
from test_dense_path import grow_on_each, outcome

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, PrefixHasher, Request
from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import EVICTION_POLICIES

pytestmark = [
    pytest.mark.both_kernels,
    pytest.mark.skipif(native is None, reason="kvspec_core.runtime._native is not built"),
]


@contextlib.contextmanager
def pure_python() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    use_pure_python(patch)
    try:
        yield
    finally:
        patch.undo()


class OnPurePython:
    """An allocator whose every method call runs with the kernels turned off."""

    def __init__(self, allocator: KVCacheAllocator) -> None:
        self._allocator = allocator

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._allocator, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            with pure_python():
                return attribute(*args, **kwargs)

        return call


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=600), digest_size=st.integers(1, 64))
def test_blake2b_equals_hashlib(data: bytes, digest_size: int) -> None:
    assert (
        native.blake2b(data, digest_size) == hashlib.blake2b(data, digest_size=digest_size).digest()
    )


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block=st.sampled_from([1, 4, 16, 33]),
    cut=st.integers(0, 200),
)
def test_chained_hashes_equal_the_python_hasher(tokens: list[int], block: int, cut: int) -> None:
    hasher = PrefixHasher(block, salt=b"tenant")
    compiled = hasher.hashes(Request("r", list(tokens)), cut)[:]
    with pure_python():
        reference = hasher.hashes(Request("r", list(tokens)), cut)[:]
    assert compiled == reference
    parent = hasher.root(Request("r", []))
    for index, digest in enumerate(reference):
        data = struct.pack(f"<{block}I", *tokens[index * block : (index + 1) * block])
        parent = hashlib.blake2b(parent + data, digest_size=32).digest()
        assert digest == parent


class TokenLike:
    """An int stand-in with ``__index__`` (as numpy integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_a_bad_token_is_refused_and_nothing_is_appended(bad: object) -> None:
    out = [b"kept"]
    tokens = [1, 2, 3, bad, 5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"token 3 is .*not an int in \[0, 2\*\*32\)"):
        native.chain_hashes(b"p" * 32, tokens, 0, 8, 4, out)
    assert out == [b"kept"]
    request = Request("r", tokens)  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match=r"request 'r': token ids in \[0, 8\)"):
        PrefixHasher(4).hashes(request, 8)
    assert request.block_hashes == []


def test_index_objects_hash_as_their_ints() -> None:
    out: list[bytes] = []
    native.chain_hashes(b"p" * 32, [TokenLike(value) for value in range(8)], 0, 8, 4, out)
    expected: list[bytes] = []
    native.chain_hashes(b"p" * 32, list(range(8)), 0, 8, 4, expected)
    assert out == expected


def test_kernels_refuse_malformed_arguments_without_crashing() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        native.chain_hashes(b"p" * 32, [1, 2, 3], 0, 3, 2, [])
    with pytest.raises(TypeError):
        native.chain_hashes("not bytes", [1, 2], 0, 2, 2, [])
    with pytest.raises(IndexError, match="block id 99"):
        native.release([99], False, [0] * 4, [None] * 4, bytearray(4), [], {}, {})
    # Found by review: an empty range with a huge block_tokens wrapped the message size
    # (a heap overflow under AddressSanitizer); nothing to hash appends nothing.
    out: list[bytes] = []
    native.chain_hashes(b"p" * 64, [], 0, 0, (1 << 62) - 8, out)
    native.chain_hashes(b"p" * 32, [], 0, 0, (1 << 63) - 1, out)
    assert out == []


CONFIGS: dict[str, tuple[list, Any, Any]] = {
    "full attention": ([full(2)], 24, None),
    "full attention, roomy pool": ([full(2)], 120, None),
    "full attention, tight pool": ([full(2)], 10, None),
    "sliding window + full, one pool": ([full(2), sliding(2, 5)], 40, None),
    "mamba + full, one pool": ([full(2), mamba(2)], 40, None),
    "two pools": ([full(2), full(4)], [16, 12], [0, 1]),
}
PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7], [])

admit_op = st.tuples(
    st.just("admit"),
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 2), max_size=12),
    st.integers(1, 8),
)
# (running request index, tokens to schedule, token to append first; -1: none, -2: a token
# that cannot be hashed; speculative slots).
grow_op = st.tuples(
    st.just("grow"),
    st.integers(0, 63),
    st.integers(0, 6),
    st.integers(-2, 2),
    st.sampled_from([0, 0, 0, 1, 3]),
)
step_op = st.tuples(st.just("step"), st.lists(st.integers(0, 63), max_size=6))
finish_op = st.tuples(st.just("finish"), st.integers(0, 63))
programs = st.lists(st.one_of(admit_op, grow_op, grow_op, step_op, finish_op), max_size=60)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    eviction=st.sampled_from(EVICTION_POLICIES),
    events=st.booleans(),
    caching=st.sampled_from([True, True, True, False]),
    program=programs,
)
def test_kernels_and_python_give_the_same_allocator(
    config: str, eviction: str, events: bool, caching: bool, program: list
) -> None:
    specs, blocks, pools = CONFIGS[config]
    options = dict(eviction=eviction, enable_kv_events=events, enable_prefix_caching=caching)
    compiled = make_allocator(specs, blocks, pools, **options)
    with pure_python():
        reference = OnPurePython(make_allocator(specs, blocks, pools, **options))
    sides = (compiled, reference)
    running: list[tuple[Request, Request]] = []
    next_id = 0
    for op in program:
        if op[0] == "admit":
            next_id = admit_on_each(sides, op, next_id, running)  # type: ignore[arg-type]
        elif op[0] == "grow" and running:
            _, index, count, token, lookahead = op
            grow_on_each(sides, running[index % len(running)], count, lookahead, token)
        elif op[0] == "step" and running:
            chosen = [running[index % len(running)] for index in op[1]]
            for pair in chosen:
                for request in pair:
                    request.append_token(1)
            # Bare requests (one token each) and pairs, mixed.
            # Each call runs at once (outcome): the defaults bind this iteration's values.
            results = [
                outcome(
                    lambda a=side, s=side_index, c=chosen: a.allocate_step(
                        [pair[s] if k % 2 else (pair[s], 1) for k, pair in enumerate(c)]
                    )
                )
                for side_index, side in enumerate(sides)
            ]
            assert results[0] == results[1]
        elif op[0] == "finish" and running:
            finish_on_each(sides, running, op[1])  # type: ignore[arg-type]
        assert_alike(compiled, reference._allocator)
        assert compiled.take_events() == reference.take_events()
    compiled.check_invariants()
    reference.check_invariants()


queue_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 11)),
        st.tuples(st.just("remove"), st.integers(0, 11)),
        st.tuples(st.just("popitem"), st.booleans()),
        st.tuples(st.just("clear"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=queue_ops)
def test_block_queue_behaves_as_an_ordered_dict_of_nones(ops: list) -> None:
    queue = native.BlockQueue(12)
    reference: OrderedDict[int, None] = OrderedDict()
    for op, value in ops:
        if op == "add":
            queue[value] = None
            reference[value] = None
        elif op == "remove":
            expected = outcome_of(functools.partial(reference.__delitem__, value))
            assert outcome_of(functools.partial(queue.__delitem__, value)) == expected
        elif op == "popitem":
            expected = outcome_of(functools.partial(reference.popitem, last=value))
            assert outcome_of(functools.partial(queue.popitem, last=value)) == expected
        else:
            queue.clear()
            reference.clear()
        assert list(queue) == list(reference)
        assert len(queue) == len(reference)
        assert all((block in queue) == (block in reference) for block in range(-1, 14))
    twin = native.BlockQueue(12)
    for block in reference:
        twin[block] = None
    # Both operators: BlockQueue implements == and != itself.
    assert twin == queue and not operator.ne(twin, queue)


def outcome_of(call: Any) -> Any:
    try:
        return call()
    except KeyError:
        return "KeyError"


def test_block_queue_refuses_what_it_cannot_hold() -> None:
    queue = native.BlockQueue(4)
    with pytest.raises(KeyError, match=re.escape("block id 4 is not in 0..3")):
        queue[4] = None
    with pytest.raises(TypeError, match="block ids"):
        queue["1"] = None
    with pytest.raises(TypeError, match="values are None"):
        queue[1] = 5
    with pytest.raises(ValueError, match="capacity"):
        native.BlockQueue(0)
    queue[1] = None
    queue[3] = None
    assert queue[1] is None and "1" not in queue and 7 not in queue
    iterator = iter(queue)
    assert next(iterator) == 1
    del queue[3]
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(iterator)
    assert repr(queue) == "BlockQueue(capacity=4, [1])"
    assert queue.__sizeof__() > native.BlockQueue(4).__sizeof__()


class ShrinkingToken:
    """A token whose ``__index__`` empties the list being hashed (hostile input)."""

    def __init__(self, tokens: list) -> None:
        self.tokens = tokens

    def __index__(self) -> int:
        self.tokens.clear()
        return 1


def test_a_token_list_changed_while_hashing_is_refused_not_crashed() -> None:
    tokens: list = [1, 2]
    tokens += [ShrinkingToken(tokens), 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="changed while they were hashed"):
        native.chain_hashes(b"p" * 32, tokens, 0, 8, 4, [])


def test_the_fast_allocate_slots_answers_as_the_method_and_is_collected() -> None:
    allocator = make_allocator([full(2)], 24)
    assert isinstance(allocator.allocate_slots, native.SlotsFastPath)
    assert allocator.allocate_slots.__doc__ == KVCacheAllocator.allocate_slots.__doc__
    request = Request("r", [1, 2, 3])
    # Admission and keyword calls go to the method itself.
    assert allocator.allocate_slots(request, 3, prefix=allocator.find_cached_prefix(request))
    request.append_token(4)
    assert allocator.allocate_slots(request, 1) is allocator.no_new_blocks
    request.append_token(5)
    assert allocator.allocate_slots(request, num_new_tokens=1).new_block_ids == ((3,),)
    with pytest.raises(AllocatorError, match="num_new_tokens=-1"):
        allocator.allocate_slots(request, -1)
    with pytest.raises(AllocatorError, match="already running"):
        allocator.allocate_slots(request, 0, 0, allocator.find_cached_prefix(Request("s", [1])))
    # The allocator and its fast path refer to each other: the collector frees both.
    reference = weakref.ref(allocator)
    del allocator
    gc.collect()
    assert reference() is None


def test_one_group_full_attention_crosses_block_boundaries_in_c() -> None:
    allocator = make_allocator([full(2)], 24)
    general_steps: list[int] = []
    method = allocator._grow_dense

    def spy(state: Any, count: int, lookahead: int) -> Any:
        general_steps.append(count)
        return method(state, count, lookahead)

    # The Python path looks the method up on the instance; the compiled step does not.
    allocator._grow_dense = spy  # type: ignore[method-assign]
    request = Request("r", [1, 2, 3, 4, 5])
    assert allocator.allocate_slots(request, 5, prefix=allocator.find_cached_prefix(request))
    request.append_token(6)
    assert allocator.allocate_slots(request, 1) is allocator.no_new_blocks  # block 3 is full
    request.append_token(7)
    assert allocator.allocate_slots(request, 1).new_block_ids == ((4,),)
    assert allocator.allocate_step([request, (request, 2)])[1].new_block_ids == ((5,),)
    assert general_steps == []
    table = allocator.block_ids("r")[0]
    assert [allocator.pools[0].cached_hash(block) for block in table] == [
        *request.block_hashes[:3],
        None,
        None,
    ]
    # A token it cannot hash the compiled step refuses itself, with the method's error; the
    # cap it leaves to the method.
    request.append_token(-5)
    with pytest.raises(AllocatorError, match=r"request 'r': token ids in \[6, 8\) .*token 7 is -5"):
        allocator.allocate_slots(request, 1)
    request.token_ids.pop()
    assert not allocator.allocate_slots(request, 60)
    assert general_steps == [60]
    allocator.check_invariants()


def test_the_compiled_boundary_step_evicts_as_the_python_one() -> None:
    sides = [make_allocator([full(2)], 8)]
    with pure_python():
        sides.append(OnPurePython(make_allocator([full(2)], 8)))
    for side in sides:
        # A's four full blocks are cached, then free; B takes the three uncached blocks, so
        # B's next block is an eviction, at a decode step.
        first = Request("a", [1, 2, 3, 4, 5, 6, 7, 8])
        assert side.allocate_slots(first, 8, prefix=side.find_cached_prefix(first))
        side.free("a")
        second = Request("b", [20, 21, 22, 23, 24, 25])
        assert side.allocate_slots(second, 6, prefix=side.find_cached_prefix(second))
        epoch = side.pools[0].epoch
        second.append_token(26)
        assert side.allocate_slots(second, 1).new_block_ids == ((1,),)  # A's last block
        assert side.pools[0].epoch == epoch + 1
        assert side.find_cached_prefix(Request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])).num_tokens == 6
    assert_alike(sides[0], sides[1]._allocator)


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_allocator([full(2), full(2)], 24),
        lambda: make_allocator([full(4)], 24, hash_block_size=2),
        lambda: make_allocator([full(2)], 24, enable_kv_events=True),
        lambda: make_allocator([full(2), sliding(2, 5)], 40),
        # A subclass's own boundary step runs as its Python code.
        lambda: type(
            "Custom",
            (KVCacheAllocator,),
            {
                "_grow_dense": lambda self, *args: KVCacheAllocator._grow_dense(self, *args),
            },
        )([full(2)], 24, context(), manager=manager_with_families()),
    ],
)
def test_the_compiled_boundary_step_serves_only_one_plain_group(make: Any) -> None:
    assert make()._compiled_dense_step() is None
    assert make_allocator([full(2)], 24)._compiled_dense_step() is not None


def test_block_queues_copy_and_pickle_in_order() -> None:
    queue = native.BlockQueue(9)
    for block in (5, 2, 7):
        queue[block] = None
    for twin in (copy.copy(queue), copy.deepcopy(queue), pickle.loads(pickle.dumps(queue))):
        assert twin == queue and list(twin) == [5, 2, 7] and twin is not queue
        twin[1] = None
        assert list(queue) == [5, 2, 7]
