"""``native.split_held`` (the tier store's sorting of a batch of victims: held by the tier,
in flight to it, repeated, to copy) answers as its Python twin, ``tier_victims.split_held``,
and refuses or survives what a hostile caller passes without crashing."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvspec_core.runtime.native import native
from kvspec_core.runtime.tier_victims import split_held

pytestmark = [
    pytest.mark.both_kernels,
    pytest.mark.skipif(native is None, reason="kvspec_core.runtime._native is not built"),
]

# Few distinct digests, so batches repeat hashes and the tier / the copies in flight hold some.
digests = st.sampled_from([bytes([value]) * 32 for value in range(12)])


@settings(max_examples=300, deadline=None)
@given(
    cache=st.dictionaries(digests, st.integers(1, 50), max_size=8),
    in_flight=st.dictionaries(digests, st.integers(1, 9), max_size=5),
    pairs=st.lists(st.tuples(digests, st.integers(0, 99)), max_size=30),
)
def test_the_kernel_sorts_a_batch_as_the_python_twin(
    cache: dict[bytes, int], in_flight: dict[bytes, int], pairs: list[tuple[bytes, int]]
) -> None:
    assert native is not None
    hashes = [digest for digest, _ in pairs]
    sources = [source for _, source in pairs]
    before = (dict(cache), dict(in_flight), list(hashes), list(sources))
    expected = split_held(cache, in_flight, hashes, sources)
    assert native.split_held(cache, in_flight, hashes, sources) == expected
    assert (cache, in_flight, hashes, sources) == before  # neither changes its arguments
    held, kept, kept_sources = expected
    # What the twin promises, stated directly (a dict-based model of the sorting).
    assert held == [cache[digest] for digest in hashes if digest in cache]
    model: dict[bytes, int] = {}
    for digest, source in pairs:
        if digest not in cache and digest not in in_flight:
            model.setdefault(digest, source)
    assert list(zip(kept, kept_sources, strict=True)) == list(model.items())


def test_bad_containers_are_refused() -> None:
    assert native is not None
    digest = b"x" * 32
    bad: tuple[tuple[Any, ...], ...] = (
        ([(digest, 1)], {}, [digest], [1]),  # a cache that is not a dict
        ({}, [], [digest], [1]),
        ({}, {}, (digest,), [1]),
        ({}, {}, [digest], (1,)),
    )
    for args in bad:
        for sort in (native.split_held, split_held):
            with pytest.raises(TypeError):
                sort(*args)
    for sort in (native.split_held, split_held):
        with pytest.raises(ValueError):  # the twin once paired them wrongly
            sort({}, {}, [digest], [1, 2])
        with pytest.raises(ValueError):
            sort({digest: 1}, {}, [digest, b"y" * 32], [1])
        with pytest.raises(TypeError):  # a list subclass's own methods would not run in C
            sort({}, {}, _ListSubclass([digest]), [1])


class _ListSubclass(list[bytes]):
    pass


def test_a_slot_of_none_counts_as_held_in_both() -> None:
    """A cache value of None is a value (the twin once read it as absent)."""
    assert native is not None
    digest = b"x" * 32
    cache: dict[bytes, Any] = {digest: None}
    for sort in (native.split_held, split_held):
        assert sort(cache, {}, [digest], [5]) == ([None], [], [])


class _Clearing(bytes):
    """A key whose equality test empties the lists being read."""

    lists: ClassVar[list[list[object]]] = []

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        for victims in self.lists:
            victims.clear()
        return False


def test_a_key_that_empties_the_lists_does_not_crash_the_kernel() -> None:
    assert native is not None
    hashes: list[object] = [_Clearing(b"a"), _Clearing(b"b"), _Clearing(b"c")]
    sources: list[object] = [1, 2, 3]
    _Clearing.lists = [hashes, sources]
    try:
        # The cache holds a colliding key, so the lookup runs __eq__, which empties both
        # lists: the loop stops at their new length.
        held, kept, kept_sources = native.split_held({_Clearing(b"z"): 5}, {}, hashes, sources)
    finally:
        _Clearing.lists = []
    assert held == [] and len(kept) == len(kept_sources) == 1


def test_an_unhashable_victim_is_an_error_not_a_crash() -> None:
    assert native is not None
    with pytest.raises(TypeError):
        native.split_held({}, {}, [[1]], [1])
    with pytest.raises(TypeError):
        split_held({}, {}, [[1]], [1])  # type: ignore[list-item]


def test_dict_prefetching_is_on_where_the_layout_is_known() -> None:
    # The kernels prefetch dict lookups only where the mirrored table layout matched a real
    # dict's at import (dict_prefetch.h): on CPython 3.11 / 3.12 it must (else the check is
    # broken and the large tiers' lookups silently slow again).
    assert native is not None
    expected = sys.implementation.name == "cpython" and sys.version_info[:2] in ((3, 11), (3, 12))
    assert native.dict_prefetch == int(expected)


class _Growing(bytes):
    """A key whose equality test grows the dict being searched (a resize frees the table
    the kernel's prefetching read a moment before)."""

    target: ClassVar[dict[object, int]] = {}

    def __hash__(self) -> int:
        return 11

    def __eq__(self, other: object) -> bool:
        grown = len(self.target)
        for number in range(grown, grown + 64):
            self.target[number.to_bytes(32, "little")] = number
        return False


def test_a_dict_resized_during_the_loop_is_read_afresh() -> None:
    assert native is not None
    cache: dict[object, int] = {_Growing(b"z"): 1}
    _Growing.target = cache
    digests = [number.to_bytes(32, "big") for number in range(40)]
    hashes: list[object] = [_Growing(b"a"), *digests, _Growing(b"b"), *digests]
    try:
        held, kept, _ = native.split_held(cache, {}, hashes, list(range(len(hashes))))
    finally:
        _Growing.target = {}
    assert held == [] and len(kept) == 42  # the two growing keys and each digest once
    # The blocks' twin: cache_blocks into a dict that grows under it.
    block_hash: list[bytes | None] = [None] * 50
    cache = {_Growing(b"z"): 1}
    _Growing.target = cache
    try:
        stored = native.cache_blocks(
            0, hashes[:42], list(range(1, 43)), cache, block_hash, None, lambda *args: None
        )
    finally:
        _Growing.target = {}
    assert stored == 42
