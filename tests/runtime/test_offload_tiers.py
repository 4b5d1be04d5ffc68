"""Offload tiers below the device: write-back on eviction, demotion down the tiers, lookups
across tiers, loads on admission, pending transfers and their failures (the random traces
are in test_tiered_state_machine.py)."""

from __future__ import annotations

import attrs
import pytest
from runtime_testkit import full, make_allocator, sliding

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import NotNow, Request
from kvspec_core.runtime.native import native
from kvspec_core.runtime.tiers import (
    KEEP_EVERYTHING,
    KEEP_FAMILY_RULES,
    LOAD,
    STORE,
    WRITE_BACK,
    WRITE_THROUGH,
    OffloadTier,
    TieredPrefix,
)


def tiered(
    num_blocks=6,
    host=5,
    disk=9,
    specs=None,
    write_policy=WRITE_BACK,
    keep=KEEP_EVERYTHING,
    **options,
):
    tiers = [OffloadTier("host", host, write_policy=write_policy, keep=keep)]
    if disk:
        tiers.append(OffloadTier("disk", disk))
    return make_allocator(specs or [full(2)], num_blocks, offload_tiers=tiers, **options)


def serve(allocator, rid, tokens, ok=True):
    """Admit a prompt, run (confirm) its transfers, free it: (prefix, transfers)."""
    request = Request(rid, tokens)
    prefix = allocator.find_cached_prefix(request)
    result = allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
    assert result, result
    transfers = allocator.take_transfers()
    allocator.complete_transfers([t.transfer_id for t in transfers], ok=ok)
    allocator.check_invariants()
    if allocator.is_running(rid):
        allocator.free(rid)
    allocator.check_invariants()
    return prefix, transfers


PROMPT_A = list(range(9))  # four full blocks of 2 tokens, one partial
PROMPT_B = list(range(100, 109))
PROMPT_C = list(range(200, 209))


def test_an_evicted_prefix_is_offloaded_and_found_in_the_host_tier() -> None:
    allocator = tiered()
    serve(allocator, "a", PROMPT_A)
    _, transfers = serve(allocator, "b", PROMPT_B)  # evicts a's four cached blocks
    assert [(t.kind, t.source_tier, t.destination_tier, t.num_blocks) for t in transfers] == [
        (STORE, 0, 1, 4)
    ]
    prefix, transfers = serve(allocator, "a2", PROMPT_A)
    assert isinstance(prefix, TieredPrefix)
    assert prefix.num_tokens == 8
    assert prefix.tokens_by_tier == (0, 8, 0)
    assert prefix.block_ids == ((0, 0, 0, 0),)
    loads = [t for t in transfers if t.kind == LOAD]
    assert len(loads) == 1 and loads[0].source_tier == 1 and loads[0].request_id == "a2"
    assert loads[0].source_blocks == tuple(slot for _, _, slot in prefix.loads[0])
    # The loaded blocks are device hits now.
    again = allocator.find_cached_prefix(Request("a3", PROMPT_A))
    assert not isinstance(again, TieredPrefix)
    assert again.block_ids == (loads[0].destination_blocks,)


def test_a_full_tier_demotes_to_the_next_and_the_last_drops() -> None:
    allocator = tiered(host=5, disk=5)
    for rid, tokens in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        serve(allocator, rid, tokens)
    # c's blocks on the device, b's on the host, a's on disk.
    prefix = allocator.find_cached_prefix(Request("a2", PROMPT_A))
    assert prefix.tokens_by_tier == (0, 0, 8)
    serve(allocator, "d", list(range(300, 309)))  # the disk drops a's blocks
    assert allocator.find_cached_prefix(Request("a3", PROMPT_A)).num_tokens == 0
    assert allocator.find_cached_prefix(Request("b2", PROMPT_B)).tokens_by_tier == (0, 0, 8)


def test_a_prefix_split_across_tiers_says_how_many_tokens_come_from_each() -> None:
    allocator = tiered(num_blocks=8)
    serve(allocator, "a", PROMPT_A)
    serve(allocator, "b", PROMPT_B)  # evicts two of a's blocks: its last two (LRU)
    prefix = allocator.find_cached_prefix(Request("a2", PROMPT_A))
    assert prefix.num_tokens == 8
    assert prefix.tokens_by_tier == (4, 4, 0)
    assert [block != 0 for block in prefix.block_ids[0]] == [True, True, False, False]


def test_a_store_in_flight_is_no_hit_and_a_failed_one_leaves_nothing() -> None:
    allocator = tiered()
    serve(allocator, "a", PROMPT_A)
    request = Request("b", PROMPT_B)
    allocator.allocate_slots(request, len(PROMPT_B), prefix=allocator.find_cached_prefix(request))
    transfers = allocator.take_transfers()
    assert [t.kind for t in transfers] == [STORE]
    assert allocator.find_cached_prefix(Request("a2", PROMPT_A)).num_tokens == 0  # pending
    allocator.check_invariants()
    allocator.complete_transfers([transfers[0].transfer_id], ok=False)
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("a3", PROMPT_A)).num_tokens == 0
    allocator.free("b")
    assert allocator.usage.used_blocks == 0


def test_a_failed_load_drops_its_request_and_its_tier_copy() -> None:
    allocator = tiered()
    serve(allocator, "a", PROMPT_A)
    serve(allocator, "b", PROMPT_B)
    request = Request("a2", PROMPT_A + [7])
    prefix = allocator.find_cached_prefix(request)
    assert isinstance(prefix, TieredPrefix)
    assert allocator.allocate_slots(request, len(request.token_ids) - 8, prefix=prefix)
    transfers = allocator.take_transfers()
    load = next(t for t in transfers if t.kind == LOAD)
    stores = [t.transfer_id for t in transfers if t.kind == STORE]
    allocator.complete_transfers(stores)
    assert allocator.complete_transfers([load.transfer_id], ok=False) == ("a2",)
    assert not allocator.is_running("a2")
    allocator.check_invariants()
    # Nothing of it is a hit: neither the blocks that never arrived nor those after them.
    assert allocator.find_cached_prefix(Request("a3", PROMPT_A + [7])).num_tokens == 0
    assert allocator.usage.used_blocks == 0
    # The request may be admitted again (it computes from scratch).
    again = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(request, len(request.token_ids), prefix=again)


def test_complete_transfers_refuses_bad_ids_and_changes_nothing() -> None:
    allocator = tiered()
    serve(allocator, "a", PROMPT_A)
    request = Request("b", PROMPT_B)
    allocator.allocate_slots(request, len(PROMPT_B), prefix=allocator.find_cached_prefix(request))
    (store,) = allocator.take_transfers()
    for bad in ([store.transfer_id, 999], [store.transfer_id, store.transfer_id], ["1"]):
        with pytest.raises(AllocatorError, match="complete_transfers"):
            allocator.complete_transfers(bad)
    with pytest.raises(AllocatorError, match="ok="):
        allocator.complete_transfers([store.transfer_id], ok=1)  # type: ignore[arg-type]
    # Found in review: a numpy id of a pending transfer was said not to be one.
    import numpy

    for bad_type in (numpy.int64(store.transfer_id), True, float(store.transfer_id)):
        with pytest.raises(AllocatorError, match=r"must be an int \(a Transfer's transfer_id\)"):
            allocator.complete_transfers([bad_type])  # type: ignore[list-item]
    allocator.check_invariants()
    allocator.complete_transfers([store.transfer_id])
    with pytest.raises(AllocatorError, match="not completed yet"):
        allocator.complete_transfers([store.transfer_id])
    assert allocator.find_cached_prefix(Request("a2", PROMPT_A)).num_tokens == 8


def test_a_prefix_whose_tier_slot_was_evicted_since_is_stale() -> None:
    allocator = tiered(host=5, disk=0)
    serve(allocator, "a", PROMPT_A)
    serve(allocator, "b", PROMPT_B)
    request = Request("a2", PROMPT_A)
    prefix = allocator.find_cached_prefix(request)
    assert isinstance(prefix, TieredPrefix)
    serve(allocator, "c", PROMPT_C)  # b to the host, a dropped
    result = allocator.allocate_slots(request, 1, prefix=prefix)
    assert isinstance(result, NotNow) and result.reason == "stale_prefix"
    allocator.check_invariants()


def test_a_forged_tier_prefix_is_refused() -> None:
    allocator = tiered()
    serve(allocator, "a", PROMPT_A)
    serve(allocator, "b", PROMPT_B)
    request = Request("a2", PROMPT_A)
    prefix = allocator.find_cached_prefix(request)
    (index, tier, slot), *rest = prefix.loads[0]
    forged = attrs.evolve(prefix, loads=(((index, tier, slot % 4 + 1), *rest),))
    with pytest.raises(AllocatorError, match="not one this allocator handed out"):
        allocator.allocate_slots(request, 1, prefix=forged)
    allocator.check_invariants()


def split_between_device_and_host():
    """An allocator whose PROMPT_A hit is half on the device, half in the host tier."""
    allocator = tiered(num_blocks=8)
    serve(allocator, "a", PROMPT_A)
    serve(allocator, "b", PROMPT_B)  # a's blocks to the host
    serve(allocator, "a3", PROMPT_A[:5])  # its first two back on the device
    return allocator


@pytest.mark.parametrize("field", ["block_ids", "num_tokens"])
def test_a_handed_out_tier_prefix_changed_in_place_is_checked_again(field) -> None:
    # An admission trusts a handed-out TieredPrefix without a per-block check only while
    # it is the very one handed out: a field replaced in place (a frozen class's
    # object.__setattr__) makes it check every block, and refuse the forgery.
    allocator = split_between_device_and_host()
    request = Request("a2", PROMPT_A)
    prefix = allocator.find_cached_prefix(request)
    assert isinstance(prefix, TieredPrefix) and prefix.tokens_by_tier == (4, 4, 0)
    device_block = next(block for block in prefix.block_ids[0] if block)
    forged = {
        # a device block named at a position it is not cached for
        "block_ids": ((device_block, device_block, 0, 0),),
        # a hit two tokens (one block) shorter: the table no longer fits it
        "num_tokens": prefix.num_tokens - 2,
    }[field]
    object.__setattr__(prefix, field, forged)
    with pytest.raises(AllocatorError, match="not one this allocator handed out"):
        allocator.allocate_slots(request, 1, prefix=prefix)
    allocator.check_invariants()


@pytest.mark.parametrize("kind", ["handed_out", "copy", "epochs_replaced"])
def test_only_the_handed_out_tier_prefix_skips_the_per_block_check(kind) -> None:
    # Handed out and unchanged, it is admitted (loads recorded) without the per-block
    # check; a copy (same values, another object) or one whose epochs were replaced in
    # place (same values) is checked, and admitted alike.
    allocator = split_between_device_and_host()
    request = Request("a2", PROMPT_A)
    prefix = allocator.find_cached_prefix(request)
    assert isinstance(prefix, TieredPrefix) and prefix.tokens_by_tier == (4, 4, 0)
    if kind == "copy":
        prefix = attrs.evolve(prefix)
    elif kind == "epochs_replaced":
        object.__setattr__(prefix, "epochs", tuple(list(prefix.epochs)))
    checked = []
    check_loads = allocator._tiers.check_loads
    allocator._tiers.check_loads = lambda *args: checked.append(1) or check_loads(*args)
    assert allocator.allocate_slots(request, 1, prefix=prefix)
    assert checked == ([] if kind == "handed_out" else [1])
    loads = [t for t in allocator.take_transfers() if t.kind == LOAD]
    assert sum(t.num_blocks for t in loads) == sum(map(len, prefix.loads))
    allocator.complete_transfers([t.transfer_id for t in loads], ok=True)
    allocator.check_invariants()


def test_a_handed_out_tier_prefix_is_stale_when_only_a_tier_dropped_its_slots() -> None:
    # Another request's failed load takes the slots out of the host tier (its epoch
    # moves) while the device evicts nothing: the unchanged, handed-out prefix is stale.
    allocator = split_between_device_and_host()
    other = Request("y", list(PROMPT_A))
    assert allocator.allocate_slots(other, 1, prefix=allocator.find_cached_prefix(other))
    request = Request("x", list(PROMPT_A))
    prefix = allocator.find_cached_prefix(request)
    assert isinstance(prefix, TieredPrefix)
    allocator.free("y")
    device_epochs = tuple(pool.epoch for pool in allocator.pools)
    transfers = allocator.take_transfers()
    allocator.complete_transfers([t.transfer_id for t in transfers], ok=False)
    assert tuple(pool.epoch for pool in allocator.pools) == device_epochs
    assert prefix.tier_epochs != allocator._tiers.tier_epochs()
    result = allocator.allocate_slots(request, 1, prefix=prefix)
    assert isinstance(result, NotNow) and result.reason == "stale_prefix"
    allocator.check_invariants()


def test_a_handed_out_tier_prefix_is_stale_when_only_the_device_dropped_its_blocks() -> None:
    # A request holding the prefix's device blocks is discarded (its blocks leave the
    # device cache, the device epoch moves) while no tier changes.
    allocator = split_between_device_and_host()
    request = Request("x", list(PROMPT_A))
    prefix = allocator.find_cached_prefix(request)
    assert isinstance(prefix, TieredPrefix) and prefix.tokens_by_tier[0] > 0
    holder = Request("z", PROMPT_A[:5])
    found = allocator.find_cached_prefix(holder)
    assert allocator.allocate_slots(holder, 5 - found.num_tokens, prefix=found)
    tier_epochs = allocator._tiers.tier_epochs()
    allocator.discard_uncomputed("z", 0)
    assert allocator._tiers.tier_epochs() == tier_epochs == prefix.tier_epochs
    assert tuple(pool.epoch for pool in allocator.pools) != prefix.epochs
    result = allocator.allocate_slots(request, 1, prefix=prefix)
    assert isinstance(result, NotNow) and result.reason == "stale_prefix"
    allocator.check_invariants()


def test_sliding_window_hits_across_tiers_follow_the_window_rules() -> None:
    # Full attention and a window of 5 tokens (3 blocks of 2), in one pool.
    specs = [full(2), sliding(2, 5)]
    allocator = tiered(num_blocks=16, host=40, disk=0, specs=specs)
    prompt = list(range(13))
    device_only = make_allocator(specs, 40)
    serve(device_only, "a", prompt)
    expected = device_only.find_cached_prefix(Request("x", prompt))
    serve(allocator, "a", prompt)
    serve(allocator, "b", list(range(100, 113)))  # a's blocks leave the device
    serve(allocator, "c", list(range(200, 213)))
    prefix = allocator.find_cached_prefix(Request("a2", prompt))
    assert isinstance(prefix, TieredPrefix)
    assert prefix.num_tokens == expected.num_tokens == 12
    for gid in (0, 1):
        # Each group gets exactly the blocks its rules need, whichever tier holds them.
        held = {index for index, block in enumerate(prefix.block_ids[gid]) if block}
        held |= {index for index, _, _ in prefix.loads[gid]}
        assert held == {index for index, block in enumerate(expected.block_ids[gid]) if block}
    assert len(prefix.loads[1]) < len(prefix.loads[0])
    serve(allocator, "a2", prompt)


def test_reset_forgets_the_tiers_and_transfers_in_flight_cache_nothing() -> None:
    allocator = tiered()
    serve(allocator, "a", PROMPT_A)
    request = Request("b", PROMPT_B)
    allocator.allocate_slots(request, len(PROMPT_B), prefix=allocator.find_cached_prefix(request))
    (store,) = allocator.take_transfers()
    allocator.reset_prefix_cache()
    allocator.complete_transfers([store.transfer_id])
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("a2", PROMPT_A)).num_tokens == 0


def test_without_tiers_nothing_changes(runtime_kernels: str) -> None:
    allocator = make_allocator([full(2)], 6)
    assert allocator.take_transfers() == []
    assert allocator.complete_transfers([]) == ()
    with pytest.raises(AllocatorError, match="no offload tiers"):
        allocator.complete_transfers([1])
    assert allocator.tier_names == ("device",)
    if runtime_kernels == "native":
        # The compiled steps and lookup stay installed.
        assert allocator._compiled_dense_step() is not None
        assert type(allocator.find_cached_prefix).__name__ == "partial"
        # With tiers too; a lookup goes on in Python where a tier holds the next block.
        with_tiers = tiered()
        assert with_tiers._compiled_dense_step() is not None
        assert with_tiers.find_cached_prefix.args[1].func is native.find_prefix


@pytest.mark.parametrize(
    ("tier", "match"),
    [
        (OffloadTier("host", 1), "must be 0"),
        (OffloadTier("host", (4, 4)), "2 entries for 1 pools"),
        (OffloadTier("host", 4, eviction="fifo"), "eviction='fifo'"),
        (OffloadTier("device", 4), "other than 'device'"),
        (OffloadTier("host", True), "must be 0"),  # type: ignore[arg-type]
    ],
)
def test_bad_tiers_are_refused_naming_the_field(tier, match) -> None:
    with pytest.raises(AllocatorError, match=match):
        make_allocator([full(2)], 6, offload_tiers=(tier,))
    with pytest.raises(AllocatorError, match=r"must be a kvspec_core\.runtime\.OffloadTier"):
        make_allocator([full(2)], 6, offload_tiers=("host",))


def _random_trace(allocator, seed: int) -> list:
    """Admissions of prompts sharing prefixes, decodes, frees, some failed transfers: what
    the allocator answers and every transfer, as plain values."""
    import random

    rng = random.Random(seed)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    seen: list = []
    running: list[Request] = []
    for step in range(120):
        action = rng.random()
        if action < 0.4 or not running:
            tokens = rng.choice(heads) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            request = Request(step, tokens)
            prefix = allocator.find_cached_prefix(request)
            result = allocator.allocate_slots(
                request, len(tokens) - prefix.num_tokens, prefix=prefix
            )
            seen.append((prefix.num_tokens, getattr(prefix, "tokens_by_tier", None), bool(result)))
            if result:
                running.append(request)
        elif action < 0.75:
            request = rng.choice(running)
            request.append_token(rng.randrange(3))
            seen.append(repr(allocator.allocate_slots(request, 1)))
        else:
            request = running.pop(rng.randrange(len(running)))
            allocator.free(request.request_id)
        transfers = allocator.take_transfers()
        seen.append([attrs.astuple(transfer) for transfer in transfers])
        fail = [t.transfer_id for t in transfers if rng.random() < 0.1]
        allocator.complete_transfers(
            [t.transfer_id for t in transfers if t.transfer_id not in fail]
        )
        dropped = allocator.complete_transfers(fail, ok=False)
        running = [request for request in running if request.request_id not in dropped]
        seen.append(dropped)
        allocator.check_invariants()
    return seen


@pytest.mark.both_kernels
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize(
    ("write_policy", "keep"),
    [(WRITE_BACK, KEEP_EVERYTHING), (WRITE_THROUGH, KEEP_FAMILY_RULES)],
)
def test_the_kernels_and_python_answer_alike_with_tiers(
    hybrid, write_policy, keep, monkeypatch
) -> None:
    from runtime_testkit import use_pure_python

    specs = [full(2), sliding(2, 5)] if hybrid else [full(2)]

    def build():
        return tiered(
            num_blocks=14 if hybrid else 8,
            host=6,
            disk=8,
            specs=specs,
            write_policy=write_policy,
            keep=keep,
        )

    if native is None:
        pytest.skip("kvspec_core.runtime._native is not built")
    compiled = [_random_trace(build(), seed) for seed in range(6)]
    use_pure_python(monkeypatch)
    assert [_random_trace(build(), seed) for seed in range(6)] == compiled


def test_a_block_evicted_twice_in_one_step_is_stored_once() -> None:
    # Evicted, computed again and evicted again before the step's take_transfers: its
    # hash is noted twice, stored once.
    allocator = tiered(host=13, disk=0)

    def admit_and_free(rid, tokens):
        request = Request(rid, tokens)
        prefix = allocator.find_cached_prefix(request)
        assert allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
        allocator.free(rid)

    admit_and_free("a", PROMPT_A)
    admit_and_free("b", PROMPT_B)  # evicts a's blocks (noted)
    admit_and_free("a2", PROMPT_A)  # computes them again (no hit: not stored yet)
    admit_and_free("c", PROMPT_C)  # evicts them again
    stores = allocator.take_transfers()
    stored = [t.num_blocks for t in stores]
    assert sum(stored) == 8  # a's four and b's four, once each
    allocator.check_invariants()
    allocator.complete_transfers([t.transfer_id for t in stores])
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("a3", PROMPT_A)).tokens_by_tier == (0, 8)


def test_loaded_blocks_enter_the_device_cache_with_their_stored_events() -> None:
    """A KV-aware router follows the device's prefix cache through the events: a block a
    load brought back is announced as when its prompt first filled it (same hashes, parent
    and tokens), so its later BlockRemoved names a block the router knows."""
    from kvspec_core.runtime.events import BlockRemoved, BlockStored

    def stored(events):
        return [
            (event.block_hashes, event.parent_block_hash, event.token_ids)
            for event in events
            if isinstance(event, BlockStored)
        ]

    allocator = tiered(enable_kv_events=True)
    serve(allocator, "a", PROMPT_A)
    first = stored(allocator.take_events())
    serve(allocator, "b", PROMPT_B)  # evicts a's blocks into the host tier
    evicted = allocator.take_events()
    hashes = first[0][0]
    assert {h for e in evicted if isinstance(e, BlockRemoved) for h in e.block_hashes} >= set(
        hashes
    )
    prefix, transfers = serve(allocator, "a2", PROMPT_A + [7])
    assert isinstance(prefix, TieredPrefix) and prefix.tokens_by_tier[1] == 8
    assert any(t.kind == LOAD for t in transfers)
    # a2's own fifth block is announced at its admission, the loaded four at the load.
    announced = stored(allocator.take_events())
    assert [event for event in announced if set(event[0]) <= set(hashes)] == first
    assert len(announced) == len(first) + 1


def test_tiers_are_refused_where_no_prefix_is_ever_cached() -> None:
    """Found in review: with prefix caching off, or a group that caches no prefix (a Mamba
    state kept only for the running request), the tiers were accepted and stayed empty:
    host memory provisioned for nothing, silently."""
    from runtime_testkit import mamba

    from kvspec_core import SizingContext

    tiers = (OffloadTier("host", 8),)
    with pytest.raises(AllocatorError, match="enable_prefix_caching=False, so the tiers would"):
        make_allocator([full(4)], 16, offload_tiers=tiers, enable_prefix_caching=False)
    running_state = SizingContext(max_model_len=64, max_in_flight_tokens=8)  # mode "none"
    with pytest.raises(AllocatorError, match=r"group 1 \(mamba\) caches no prefix"):
        make_allocator([full(4), mamba(4)], [16, 8], [0, 1], ctx=running_state, offload_tiers=tiers)
    make_allocator([full(4)], 16, offload_tiers=tiers)  # caching: accepted
