"""The batched forms of the tiers' bookkeeping give what their per-block references give:
the stores of one group's evictions (``TierStoring._store_group`` against the per-block
``_store_each``), the scan across tiers (``tier_view.continued_run`` against
``TieredView.get`` hash by hash), and the victims an eviction reports to the pool's hook
(collected by ``evict_take`` itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from runtime_testkit import full, make_allocator, sliding

from kvspec_core.runtime import Request
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.tier_view import TieredView, continued_run
from kvspec_core.runtime.tiers import OffloadTier

# ----------------------------------------------------------------- the scan across tiers

keys = st.integers(0, 11).map(lambda number: bytes([number]))


def run_by_get(hashes: list[bytes], view: TieredView, start: int, stop: int) -> list[int]:
    found = []
    for digest in hashes[start:stop]:
        value = view.get(digest)
        if value is None:
            break
        found.append(value)
    return found


@settings(max_examples=300, deadline=None)
@given(
    device=st.dictionaries(keys, st.integers(1, 50), max_size=8),
    tiers=st.lists(st.dictionaries(keys, st.integers(0, 50), max_size=10), min_size=1, max_size=3),
    hashes=st.lists(keys, max_size=14),
    start=st.integers(0, 14),
    stop=st.integers(0, 16),
)
def test_the_continued_run_is_what_get_gives_hash_by_hash(
    device: dict[bytes, int],
    tiers: list[dict[bytes, int]],
    hashes: list[bytes],
    start: int,
    stop: int,
) -> None:
    # Tier numbers with gaps (a tier with no slots for the pool is not in the view).
    view = TieredView(device, [(2 * number + 1, cache) for number, cache in enumerate(tiers)], 7)
    stop = min(stop, len(hashes))
    assert continued_run(hashes, view, start, stop) == run_by_get(hashes, view, start, stop)
    assert continued_run(tuple(hashes), view, start, stop) == run_by_get(hashes, view, start, stop)


def test_the_device_keeps_priority_inside_a_tier_run() -> None:
    a, b, c, d = (bytes([number]) for number in range(4))
    view = TieredView({c: 9}, [(1, {a: 0, b: 1, c: 2, d: 3})], 1)
    # b and d come from the tier (codes -(slot * 1 + 1)), c from the device.
    assert continued_run([a, b, c, d], view, 1, 4) == [-2, 9, -4]


# ----------------------------------------------------------------- the stores


def tiered_allocator(reference: bool) -> Any:
    allocator = make_allocator(
        [full(2)],
        8,
        offload_tiers=[OffloadTier("host", 5), OffloadTier("disk", 6)],
    )
    if reference:
        tiers: Any = allocator._tiers

        def store_each(index, pool, gid, hashes, source_tier, sources):
            tiers._store_each(index, pool, [gid] * len(hashes), hashes, source_tier, sources)

        tiers._store_group = store_each
    return allocator


def hybrid_allocator(reference: bool) -> Any:
    """Full attention and a sliding window (2 blocks) sharing one pool and its tiers: a
    batch of victims mixes the groups' blocks (``_store_mixed``; the reference stores
    them block by block, ``_store_each``)."""
    allocator = make_allocator(
        [full(2), sliding(2, 4)],
        12,
        pool_of_group=[0, 0],
        offload_tiers=[OffloadTier("host", 7), OffloadTier("disk", 6)],
    )
    if reference:
        tiers: Any = allocator._tiers
        tiers._store_mixed = tiers._store_each
    return allocator


def transfers_of(allocator: Any, taken: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            transfer.transfer_id,
            transfer.kind,
            transfer.source_tier,
            transfer.destination_tier,
            transfer.source_blocks,
            transfer.destination_blocks,
            transfer.block_hashes,
        )
        for transfer in taken
    ]


def tier_state(allocator: Any) -> list[Any]:
    tiers = allocator._tiers
    return [
        [
            (
                {gid: dict(cache) for gid, cache in slots.caches.items()},
                list(slots._evictable),
                slots.num_free_blocks,
            )
            for slots in row
        ]
        for row in tiers.tier_pools
    ] + [
        tiers.blocks_moved,
        [{gid: dict(flying) for gid, flying in storing.items()} for storing in tiers._storing],
    ]


PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 9, 9, 9],
    [5, 5, 6, 6, 7, 7, 8],
    [8, 7, 6, 5, 4, 3, 2, 1, 0],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]
actions = st.lists(
    st.tuples(
        st.sampled_from(["serve", "serve and settle", "take", "complete", "fail"]),
        st.integers(0, len(PROMPTS) - 1),
        st.integers(0, 2),
    ),
    max_size=40,
)


def serve_both(
    actions: list[tuple[str, int, int]], allocator_for: Callable[[bool], Any] | None = None
) -> None:
    """Run ``actions`` on an allocator storing in batches and on one storing block by
    block (``allocator_for(reference)``; default :func:`tiered_allocator`): the same hits,
    transfers, tier contents and eviction orders after each."""
    make = allocator_for or tiered_allocator
    batched, reference = make(False), make(True)
    handed: list[list[Any]] = [[], []]
    for step, (kind, prompt, extra) in enumerate(actions):
        seen: list[Any] = []
        for side, allocator in enumerate((batched, reference)):
            if kind.startswith("serve"):
                request = Request(f"r{step}", PROMPTS[prompt] + [prompt] * extra)
                prefix = allocator.find_cached_prefix(request)
                result = allocator.allocate_slots(
                    request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
                )
                if result:
                    allocator.free(request.request_id)
                seen.append((prefix.num_tokens, bool(result)))
                if kind == "serve and settle":
                    # As an engine does: the step's transfers, run and confirmed.
                    taken = allocator.take_transfers()
                    seen.append(transfers_of(allocator, taken))
                    allocator.complete_transfers([t.transfer_id for t in taken], True)
            elif kind == "take":
                taken = allocator.take_transfers()
                handed[side].extend(taken)
                seen.append(transfers_of(allocator, taken))
            elif handed[side]:
                done = handed[side][: extra + 1]
                del handed[side][: extra + 1]
                allocator.complete_transfers([t.transfer_id for t in done], kind == "complete")
            allocator.check_invariants()
            seen.append(tier_state(allocator))
        assert seen[: len(seen) // 2] == seen[len(seen) // 2 :], f"step {step}: {kind}"


@settings(max_examples=300, deadline=None)
@given(actions=actions)
def test_batched_stores_are_the_per_block_stores(actions: list[tuple[str, int, int]]) -> None:
    """Random serving, transfers taken and confirmed (or failed) at once or later."""
    serve_both(actions)


HELD_IN_FLIGHT_OR_EVICTED_TWICE = [
    ("serve and settle", 0, 0),
    ("serve and settle", 3, 0),  # 0's blocks to the host
    ("serve and settle", 0, 0),  # loaded back from the host
    ("serve and settle", 3, 0),  # evicted again: the host holds them
    ("serve", 0, 1),
    ("serve", 3, 1),
    ("serve", 0, 1),
    ("serve", 3, 1),  # 0's new blocks evicted twice since the last take
    ("take", 0, 0),
    ("serve", 0, 1),
    ("serve", 3, 1),  # evicted while their stores are in flight
    ("take", 0, 0),
    ("complete", 0, 2),
    ("serve and settle", 2, 2),
]


@pytest.mark.parametrize("allocator_for", [tiered_allocator, hybrid_allocator])
def test_batched_stores_skip_what_is_held_in_flight_or_evicted_twice(
    allocator_for: Callable[[bool], Any],
) -> None:
    """A hash stored and loaded back, evicted again (held by the host: refreshed, several
    at once, in batch order); one evicted twice between takes (stored once); one evicted
    while its store is in flight (skipped). One group, and a hybrid's two."""
    serve_both(HELD_IN_FLIGHT_OR_EVICTED_TWICE, allocator_for)


@settings(max_examples=300, deadline=None)
@given(actions=actions)
def test_a_hybrids_mixed_batches_store_as_block_by_block(
    actions: list[tuple[str, int, int]],
) -> None:
    """Both groups' victims in one batch, held, in flight, repeated or new, room or not:
    the whole-list form gives the reference's transfers (ids, order, blocks), tier
    contents, eviction orders and in-flight maps."""
    serve_both(actions, hybrid_allocator)


def test_a_hybrids_mixed_batches_go_through_the_whole_list_form() -> None:
    """The hybrid test above exercises ``_store_mixed`` (not only the bulk path): a
    batch holding blocks the host tier already has takes it."""
    allocator = hybrid_allocator(False)
    tiers: Any = allocator._tiers
    calls: list[int] = []
    mixed = tiers._store_mixed

    def counted(*args: Any) -> None:
        calls.append(len(args[2]))
        mixed(*args)

    tiers._store_mixed = counted
    for step, prompt in enumerate((0, 3, 0, 3, 0, 3)):
        request = Request(f"r{step}", PROMPTS[prompt])
        prefix = allocator.find_cached_prefix(request)
        if allocator.allocate_slots(
            request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
        ):
            allocator.free(request.request_id)
        taken = allocator.take_transfers()
        allocator.complete_transfers([t.transfer_id for t in taken], True)
    assert calls, "no batch took the whole-list form"
    allocator.check_invariants()


# ----------------------------------------------------------------- the eviction hook


def test_the_hook_is_told_each_victims_group_and_hash_in_eviction_order() -> None:
    pool = BlockPool(7, (0, 3))
    told: list[tuple[list[int], list[bytes], list[int]]] = []
    pool._on_evict = lambda groups, hashes, blocks: told.append((groups, hashes, blocks))
    blocks = pool.take(6)
    pool.cache_blocks(3, [b"a", b"b"], blocks[:2])
    pool.cache_blocks(0, [b"c", b"d", b"e"], blocks[2:5])
    pool.release([blocks[4], blocks[0], blocks[2], blocks[1], blocks[3], blocks[5]])
    # One uncached free block (blocks[5]) first, then four cached ones, oldest first.
    taken = pool.take(5)
    assert taken[0] == blocks[5]
    assert told == [
        ([0, 3, 0, 3], [b"e", b"a", b"c", b"b"], [blocks[4], blocks[0], blocks[2], blocks[1]])
    ]
    assert pool.caches == {0: {b"d": blocks[3]}, 3: {}}
    pool.check_invariants()
