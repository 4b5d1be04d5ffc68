"""``native.store_victims`` (a batch of one group's victims stored into an offload tier's pool
in one C call: sorted against the tier's cache and the copies in flight, the held ones
refreshed, slots taken, the copies recorded) answers as its Python twin,
``tier_victims.store_victims``: the same result, the same pool afterwards, the same
refusals (same exception, nothing changed)."""

from __future__ import annotations

from array import array
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvspec_core.runtime import pool as pool_module
from kvspec_core.runtime import tier_victims
from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.tier_victims import store_victims

pytestmark = [
    pytest.mark.both_kernels,
    pytest.mark.skipif(native is None, reason="kvspec_core.runtime._native is not built"),
]

# Few distinct digests, so batches repeat hashes and the tier / the copies in flight hold some.
DIGESTS = [bytes([value]) * 32 for value in range(16)]
digests = st.sampled_from(DIGESTS)


def build_pool(
    size: int, eviction: str, cached: list[bytes], reused: list[int], in_use: list[int]
) -> BlockPool:
    """A one-group tier pool of ``size`` blocks holding ``cached`` (each in its own slot),
    the slots ``reused`` touched once more (segmented: protected), those ``in_use`` kept
    in use, the others released (evictable), oldest first."""
    pool = BlockPool(size, eviction=eviction)
    unique = list(dict.fromkeys(cached))[: size - 1]
    if unique:
        blocks = pool.take(len(unique))
        pool.cache_blocks(0, unique, blocks)
        again = [block for index, block in enumerate(blocks) if index in reused]
        if again:
            pool.touch(again)
            pool.release(again)
        pool.release([block for index, block in enumerate(blocks) if index not in in_use])
    return pool


def pure_pool(*args: Any) -> BlockPool:
    """:func:`build_pool` as the pure-Python code builds it (OrderedDict eviction orders)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool_module, "native", None)
        return build_pool(*args)


def state(pool: BlockPool) -> tuple[Any, ...]:
    return (
        list(pool.ref_counts),
        {gid: dict(cache) for gid, cache in pool.caches.items()},
        list(pool._evictable),
        list(pool._protected),
        list(pool._fresh),
        list(pool._block_hash),
        bytes(pool._reused),
        pool.epoch,
        pool.num_free_blocks,
    )


def outcome(store: Any, pool: BlockPool, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``store`` returns or raises on ``pool``, with the pool and arguments after."""
    in_flight, hashes, sources = (dict(args[0]), list(args[1]), list(args[2]))
    outs: tuple[list[Any], list[Any], list[Any]] = ([7], [8], [b"old"])
    try:
        result: Any = store(pool, in_flight, hashes, sources, *outs, args[3])
    except Exception as error:  # the same exception type is asserted
        result = type(error)
    return result, state(pool), in_flight, hashes, sources, outs


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(2, 12),
    eviction=st.sampled_from(["lru", "segmented"]),
    cached=st.lists(digests, max_size=12),
    reused=st.sets(st.integers(0, 11), max_size=5),
    in_use=st.sets(st.integers(0, 11), max_size=5),
    in_flight=st.dictionaries(digests, st.integers(1, 9), max_size=5),
    pairs=st.lists(st.tuples(digests, st.integers(0, 99)), max_size=30),
    transfer_id=st.integers(0, 20),
)
def test_the_kernel_stores_a_batch_as_the_python_twin(
    size: int,
    eviction: str,
    cached: list[bytes],
    reused: set[int],
    in_use: set[int],
    in_flight: dict[bytes, int],
    pairs: list[tuple[bytes, int]],
    transfer_id: int,
) -> None:
    assert native is not None
    plan = (size, eviction, cached, sorted(reused), sorted(in_use))
    hashes = [digest for digest, _ in pairs]
    args = (in_flight, hashes, [source for _, source in pairs], transfer_id)
    expected = outcome(store_victims, build_pool(*plan), args)
    assert outcome(native.store_victims, build_pool(*plan), args) == expected
    # The twin on the pure-Python pool (OrderedDict eviction orders) stores the same.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tier_victims, "native", None)
        assert outcome(store_victims, pure_pool(*plan), args) == expected
    # What the twin promises, stated directly (a model of the store).
    stored, after, flying, _, _, (out_sources, out_slots, out_hashes) = expected
    pool = build_pool(*plan)
    cache = dict(pool.caches[0])
    model: dict[bytes, int] = {}
    for digest, source in pairs:
        if digest not in cache and digest not in in_flight:
            model.setdefault(digest, source)
    kept = list(model.items())[max(0, len(model) - pool.num_free_blocks) :]
    assert stored == len(kept) == len(out_slots) - 1
    assert list(zip(out_hashes[1:], out_sources[1:], strict=True)) == kept
    assert flying == {**in_flight, **dict.fromkeys(out_hashes[1:], transfer_id)}
    # Each copy's slot in use (cached once the copy completes), no longer in the cache.
    assert all(after[0][slot] == 1 for slot in out_slots[1:])
    assert not set(out_slots[1:]) & set(after[1][0].values())
    for digest in {digest for digest, _ in pairs if digest in cache}:
        slot = cache[digest]  # held: refreshed (in use, or its eviction order's newest)
        if after[1][0].get(digest) == slot and after[0][slot] == 0:
            assert slot in after[2][-len(cache) :] + after[3]


def _pool() -> BlockPool:
    pool = build_pool(6, "lru", DIGESTS[:3], [], [0])
    pool.caches[0][DIGESTS[5]] = 2
    return pool


def _refusals() -> list[tuple[str, Any, type[Exception]]]:
    """(what, change of the arguments or the pool, the exception both raise)."""
    digest = DIGESTS[9]

    def arg(index: int, value: Any) -> Any:
        return lambda args, pool: args.__setitem__(index, value)

    def item(index: int, value: Any) -> Any:
        return lambda args, pool: args[index].__setitem__(-1, value)

    def attr(name: str, value: Any) -> Any:
        return lambda args, pool: setattr(pool, name, value)

    def drop(name: str) -> Any:
        return lambda args, pool: delattr(pool, name)

    def cache_value(value: Any) -> Any:
        return lambda args, pool: pool.caches[0].__setitem__(args[2][0], value)

    return [
        ("in_flight a list", arg(1, []), TypeError),
        ("hashes a tuple", arg(2, (digest,)), TypeError),
        ("sources a tuple", arg(3, (1,)), TypeError),
        ("out_sources a tuple", arg(4, ()), TypeError),
        ("out_destinations None", arg(5, None), TypeError),
        ("out_hashes a dict", arg(6, {}), TypeError),
        ("transfer id a bool", arg(7, True), TypeError),
        ("transfer id a str", arg(7, "1"), TypeError),
        ("hashes a list subclass", arg(2, _ListSubclass([digest])), TypeError),
        ("a hash a str", item(2, "x"), TypeError),
        ("a hash a bytearray", item(2, bytearray(digest)), TypeError),
        ("a hash a bytes subclass", item(2, _BytesSubclass(digest)), TypeError),
        ("a source a bool", item(3, True), TypeError),
        ("a source a float", item(3, 1.0), TypeError),
        ("a source an int subclass", item(3, _IntSubclass(1)), TypeError),
        ("more sources", arg(3, [1, 2, 3, 4, 5, 6]), ValueError),
        ("fewer sources", arg(3, [1]), ValueError),
        ("ref counts a tuple", attr("ref_counts", (0,) * 6), TypeError),
        ("no ref counts at all", attr("ref_counts", []), ValueError),  # no slot to name
        ("no ref counts", drop("ref_counts"), AttributeError),
        ("events", attr("_events", []), ValueError),
        ("no events", drop("_events"), AttributeError),
        ("two groups", attr("caches", {0: {}, 1: {}}), TypeError),
        ("no group", attr("caches", {}), TypeError),
        ("caches a list", attr("caches", [{}]), TypeError),
        ("a cache a list", attr("caches", {0: []}), TypeError),
        ("a dict eviction order", attr("_evictable", {}), TypeError),
        ("no eviction order", drop("_protected"), AttributeError),
        ("a cache naming slot 0", cache_value(0), ValueError),
        ("a cache naming no slot", cache_value(6), ValueError),
        ("a cache naming a negative", cache_value(-1), ValueError),
        ("a cache naming a huge int", cache_value(2**70), ValueError),
        ("a cache naming a bool", cache_value(True), ValueError),
        ("a cache naming None", cache_value(None), ValueError),
    ]


class _ListSubclass(list[bytes]):
    pass


class _BytesSubclass(bytes):
    pass


class _IntSubclass(int):
    pass


@pytest.mark.parametrize(
    ("what", "change", "error"), _refusals(), ids=[what for what, _, _ in _refusals()]
)
def test_refusals_are_the_same_and_change_nothing(what: str, change: Any, error: type) -> None:
    assert native is not None
    results = []
    for store in (native.store_victims, store_victims):
        pool = _pool()
        # A held hash, one in flight, a repeat and two new ones: every branch reached.
        hashes = [DIGESTS[9], DIGESTS[0], DIGESTS[12], DIGESTS[9], DIGESTS[11]]
        args: list[Any] = [pool, {DIGESTS[12]: 3}, hashes, [1, 2, 3, 4, 5], [], [], [], 4]
        change(args, pool)
        before = (state_or_none(pool), repr(args[1:]))
        with pytest.raises(error):
            store(*args)
        assert (state_or_none(pool), repr(args[1:])) == before, what
        results.append(before)
    assert results[0] == results[1]


def state_or_none(pool: BlockPool) -> Any:
    try:
        return state(pool)
    except (AttributeError, TypeError):
        return None


def test_a_pure_python_pool_is_refused_by_both_where_the_kernels_are_built() -> None:
    assert native is not None
    for store in (native.store_victims, store_victims):
        pool = pure_pool(6, "lru", DIGESTS[:3], [], [])
        before = state(pool)
        with pytest.raises(TypeError):
            store(pool, {}, [DIGESTS[9]] * 6, list(range(6)), [], [], [], 1)
        assert state(pool) == before


def test_a_full_pool_evicts_its_oldest_entries_for_the_newest_victims() -> None:
    assert native is not None
    results = []
    for store in (native.store_victims, store_victims):
        pool = build_pool(4, "lru", DIGESTS[:3], [], [])  # 3 slots, all cached, all free
        out: tuple[list[int], list[int], list[bytes]] = ([], [], [])
        in_flight: dict[bytes, int] = {}
        victims = DIGESTS[5:10]
        stored = store(pool, in_flight, victims, list(range(5)), *out, 2)
        assert stored == 3 and out[2] == victims[2:] and out[0] == [2, 3, 4]
        assert sorted(out[1]) == [1, 2, 3] and pool.caches[0] == {}
        assert in_flight == dict.fromkeys(victims[2:], 2)
        results.append((out, state(pool)))
    assert results[0] == results[1]


class _Clearing(bytes):
    """A cache key colliding with every victim whose equality test empties the lists the
    kernel reads and replaces the pool's containers by copies."""

    target: ClassVar[list[Any]] = []

    def __hash__(self) -> int:
        return hash(DIGESTS[9])

    def __eq__(self, other: object) -> bool:
        for victims in self.target[:2]:
            victims.clear()
        for pool in self.target[2:]:
            pool.ref_counts = list(pool.ref_counts)
            pool.caches = {0: dict(pool.caches[0])}
        return False


def test_code_run_by_a_cache_key_does_not_crash_the_kernel() -> None:
    assert native is not None
    pool = build_pool(6, "lru", DIGESTS[:3], [], [])
    pool.caches[0][_Clearing(b"z")] = 4
    hashes = [DIGESTS[9], DIGESTS[10], DIGESTS[11]]
    sources = [1, 2, 3]
    _Clearing.target = [hashes, sources, pool]
    try:
        stored = native.store_victims(pool, {}, hashes, sources, [], [], [], 1)
    finally:
        _Clearing.target = []
    assert stored == 1  # the first victim (held meanwhile); the loop stopped at the new length


class _SwappingStack(array):
    """A free stack whose length replaces the pool's containers by copies (the old ones
    freed): what the kernel read from the pool before must be held, not borrowed."""

    pool: ClassVar[list[BlockPool]] = []

    def __len__(self) -> int:
        for pool in self.pool:
            pool.ref_counts = list(pool.ref_counts)
            pool._block_hash = list(pool._block_hash)
            pool.caches = {gid: dict(cache) for gid, cache in pool.caches.items()}
        return super().__len__()


@pytest.mark.parametrize("victims", [2, 5])  # free blocks only; and evictions too
def test_a_pool_whose_containers_are_replaced_meanwhile_is_no_crash(victims: int) -> None:
    assert native is not None
    pool = build_pool(6, "lru", DIGESTS[:3], [], [])  # 2 fresh slots, 3 cached free
    pool._fresh = _SwappingStack("i", pool._fresh)
    _SwappingStack.pool = [pool]
    try:
        out: tuple[list[int], list[int], list[bytes]] = ([], [], [])
        stored = native.store_victims(
            pool, {}, DIGESTS[8 : 8 + victims], list(range(victims)), *out, 1
        )
    finally:
        _SwappingStack.pool = []
    # (The counts went into the lists the kernel held, since replaced: a hostile pool gets
    # no promise beyond this and no crash.)
    assert stored == victims and len(out[1]) == len(set(out[1])) == victims
