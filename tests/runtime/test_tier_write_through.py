"""Write-through offload tiers (``OffloadTier.write_policy="write_through"``): a block is
copied to the first tier by the first ``take_transfers()`` after the step that cached it,
its eviction then copies nothing, and every guarantee of the tiers holds (pending copies,
failed copies, reset, blocks discarded before or after their copy). The random traces are
in test_tiered_state_machine.py (write-through is one of its draws)."""

from __future__ import annotations

import pytest
from runtime_testkit import full, make_allocator

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import Request
from kvspec_core.runtime.tiers import (
    STORE,
    WRITE_BACK,
    WRITE_THROUGH,
    OffloadTier,
    TieredPrefix,
    tiers_from_plan,
)

PROMPT_A = list(range(9))  # four full blocks of 2 tokens, one partial
PROMPT_B = list(range(100, 109))


def through(num_blocks=6, host=9, disk=0, **options):
    tiers = [OffloadTier("host", host, write_policy=WRITE_THROUGH)]
    if disk:
        tiers.append(OffloadTier("disk", disk))
    return make_allocator([full(2)], num_blocks, offload_tiers=tiers, **options)


def admit(allocator, rid, tokens):
    request = Request(rid, list(tokens))  # a copy: decode appends to it
    prefix = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
    return prefix


def step(allocator, ok=True):
    """One engine step's transfers: take them, confirm them (or fail them)."""
    transfers = allocator.take_transfers()
    allocator.complete_transfers([t.transfer_id for t in transfers], ok=ok)
    allocator.check_invariants()
    return transfers


def decode(allocator, rid, token=0):
    """The engine schedules ``rid`` again (so the forward of its last step ran): one
    decode token."""
    request = allocator._running[rid].request
    request.append_token(token)
    assert allocator.allocate_slots(request, 1)


def stores(transfers):
    return [
        (t.source_tier, t.destination_tier, t.source_blocks) for t in transfers if t.kind == STORE
    ]


def host_hit(allocator, tokens):
    prefix = allocator.find_cached_prefix(Request("probe", tokens))
    return prefix.tokens_by_tier[1] if isinstance(prefix, TieredPrefix) else 0


def test_a_cached_block_is_copied_after_its_forward_and_its_eviction_copies_nothing() -> None:
    allocator = through()
    admit(allocator, "a", PROMPT_A)
    # The step that cached a's blocks: their forward has not run yet, nothing is copied.
    assert stores(step(allocator)) == []
    blocks = allocator.block_ids("a")[0][:4]
    # A take before a is scheduled again copies nothing: its forward may not have run.
    assert stores(step(allocator)) == []
    # The step after that forward copies them (a's next allocation says it ran).
    decode(allocator, "a")
    assert stores(step(allocator)) == [(0, 1, tuple(blocks))]
    fifth = allocator.block_ids("a")[0][4]  # cached by the decode, copied once a is freed
    allocator.free("a")
    assert stores(step(allocator)) == [(0, 1, (fifth,))]
    assert stores(step(allocator)) == []  # copied once
    admit(allocator, "b", PROMPT_B)  # evicts a's blocks: the host holds them already
    assert stores(step(allocator)) == []
    assert host_hit(allocator, PROMPT_A) == 8
    assert allocator._tiers.blocks_moved == {(0, 1): 5}


def test_write_back_stays_the_default() -> None:
    assert OffloadTier("host", 4).write_policy == WRITE_BACK
    allocator = make_allocator([full(2)], 6, offload_tiers=(OffloadTier("host", 9),))
    admit(allocator, "a", PROMPT_A)
    assert stores(step(allocator)) == [] and stores(step(allocator)) == []
    allocator.free("a")
    admit(allocator, "b", PROMPT_B)
    assert [kind[:2] for kind in stores(step(allocator))] == [(0, 1)]  # on eviction


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ((OffloadTier("host", 4, write_policy="through"),), "write_policy='through' is invalid"),
        (
            (OffloadTier("host", 4), OffloadTier("disk", 4, write_policy=WRITE_THROUGH)),
            r"offload_tiers\[1\] \('disk'\).*set it on offload_tiers\[0\]",
        ),
    ],
)
def test_a_bad_write_policy_is_refused_naming_the_field(tiers, match) -> None:
    with pytest.raises(AllocatorError, match=match):
        make_allocator([full(2)], 6, offload_tiers=tiers)


def test_a_pool_without_slots_in_the_first_tier_writes_through_to_its_own() -> None:
    # Pool 1 has no slot in the host tier: the disk tier is the one its blocks go to.
    allocator = make_allocator(
        [full(2), full(2)],
        [6, 6],
        [0, 1],
        offload_tiers=(
            OffloadTier("host", (9, 0)),
            OffloadTier("disk", (9, 9), write_policy=WRITE_THROUGH),
        ),
    )
    assert allocator._tiers._through == [False, True]


def test_tiers_from_plan_gives_the_policy_to_the_first_tier() -> None:
    class Planned:
        def __init__(self, name):
            self.name = name
            self.blocks_per_pool = (8,)

    class Plan:
        tiers = (Planned("host"), Planned("disk"))

    host, disk = tiers_from_plan(Plan(), "segmented", WRITE_THROUGH)
    assert (host.write_policy, disk.write_policy) == (WRITE_THROUGH, WRITE_BACK)
    assert host.eviction == disk.eviction == "segmented"


def test_a_failed_copy_loses_nothing_the_eviction_stores_it() -> None:
    allocator = through()
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    decode(allocator, "a")
    assert len(stores(step(allocator, ok=False))) == 1
    assert host_hit(allocator, PROMPT_A) == 0  # no false hit: the copy failed
    allocator.free("a")
    admit(allocator, "b", PROMPT_B)
    assert [kind[:2] for kind in stores(step(allocator))] == [(0, 1)]  # stored on eviction
    assert host_hit(allocator, PROMPT_A) == 8


def test_a_copy_in_flight_is_no_hit_and_its_device_blocks_are_not_evictable() -> None:
    allocator = through(host=5)  # four slots: exactly a's blocks
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    allocator.free("a")  # freed: its forward ran
    (copy,) = allocator.take_transfers()
    assert host_hit(allocator, PROMPT_A) == 0
    # The copy holds a's device blocks until it completes: b cannot evict them.
    request = Request("b", list(PROMPT_B))
    assert not allocator.allocate_slots(request, len(PROMPT_B))
    allocator.check_invariants()
    allocator.complete_transfers([copy.transfer_id])
    assert host_hit(allocator, PROMPT_A) == 0  # still a device hit
    admit(allocator, "b", PROMPT_B)  # evicts a's blocks: the host holds them already
    assert stores(step(allocator)) == []
    assert host_hit(allocator, PROMPT_A) == 8


def test_a_copy_that_fails_after_its_request_was_freed_loses_nothing() -> None:
    # The copy is run but confirmed later; meanwhile a is freed and b needs its blocks.
    # The device keeps them for the copy, so its failure leaves them cached there, and
    # b's eviction stores them (before: evicted with the store skipped, the hash being in
    # flight, then lost with the failed copy).
    allocator = through(host=9)
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    decode(allocator, "a")
    (copy,) = allocator.take_transfers()
    allocator.free("a")
    assert not allocator.allocate_slots(Request("b", list(PROMPT_B)), len(PROMPT_B))
    allocator.complete_transfers([copy.transfer_id], ok=False)
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("probe", PROMPT_A)).num_tokens == 8
    admit(allocator, "b", PROMPT_B)
    assert [kind[:2] for kind in stores(step(allocator))] == [(0, 1)]  # stored at eviction
    assert host_hit(allocator, PROMPT_A) == 8


def test_reset_before_the_copy_copies_nothing() -> None:
    allocator = through()
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    allocator.reset_prefix_cache()
    assert stores(step(allocator)) == []
    assert host_hit(allocator, PROMPT_A) == 0


# ------------------------------------------------------------------ discard_uncomputed
def test_a_block_discarded_before_its_copy_is_not_copied() -> None:
    allocator = through()
    admit(allocator, "a", PROMPT_A)
    step(allocator)  # notes a's blocks
    allocator.discard_uncomputed("a", 0)  # its forward failed
    assert stores(step(allocator)) == []
    assert host_hit(allocator, PROMPT_A) == 0


def test_a_discarded_block_cached_again_by_another_request_is_not_copied_early() -> None:
    # a's forward fails; c computes the same prompt in the next step and gets the very
    # blocks back, cached under the same hashes: the note taken for a's blocks must not
    # copy them before c's forward wrote them.
    allocator = through()
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    noted = allocator.block_ids("a")[0][:4]
    allocator.discard_uncomputed("a", 0)
    admit(allocator, "c", PROMPT_A)
    assert set(allocator.block_ids("c")[0][:4]) & set(noted)  # the case this test is about
    assert stores(step(allocator)) == []  # c's forward has not run
    decode(allocator, "c")
    assert [kind[:2] for kind in stores(step(allocator))] == [(0, 1)]  # now it has


def test_a_discarded_block_whose_hash_moved_is_not_copied_when_cached_again() -> None:
    # a's fourth block is noted; b computes the same block (its lookup stops a token short)
    # and the hash moves to b's copy, so a's block is uncached while a still holds it. The
    # step fails (both discarded), and c, computing the same prompt, gets a's block back at
    # that position, cached under that hash before c's forward: a's note must not copy it
    # then (it would put a's never-written content in the host tier under that hash).
    # Found by the issue-20 review's fuzzer (seed 1165, sliding window, write-through).
    allocator = through(num_blocks=10)
    admit(allocator, "a", [7] * 8 + [2])
    step(allocator)  # notes a's blocks
    a_block = allocator.block_ids("a")[0][3]
    admit(allocator, "b", [7] * 8)
    assert allocator.pools[0]._block_hash[a_block] is None  # moved to b's copy
    allocator.discard_uncomputed("a", 0)
    allocator.discard_uncomputed("b", 6)
    admit(allocator, "f", list(range(300, 306)))  # takes three blocks first
    admit(allocator, "c", [7] * 8 + [5])
    assert allocator.block_ids("c")[0][3] == a_block  # the case this test is about
    assert stores(step(allocator)) == []  # c's forward has not run
    decode(allocator, "c")
    assert [kind[:2] for kind in stores(step(allocator))] == [(0, 1)]  # now it has


def test_a_block_discarded_while_its_copy_is_in_flight_is_no_tier_hit() -> None:
    allocator = through()
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    decode(allocator, "a")
    (copy,) = allocator.take_transfers()  # the engine runs it...
    allocator.discard_uncomputed("a", 4)  # ...then learns the forward wrote 4 tokens only
    allocator.complete_transfers([copy.transfer_id])
    allocator.check_invariants()
    # The host caches the two blocks the forward wrote, not the two it did not.
    assert allocator._tiers.tier_pools[0][0].num_cached_blocks == 2
    assert allocator.find_cached_prefix(Request("probe", PROMPT_A)).num_tokens == 4


def test_a_block_discarded_after_its_copy_was_confirmed_leaves_the_tiers_too() -> None:
    allocator = through(disk=9)
    admit(allocator, "a", PROMPT_A)
    step(allocator)
    decode(allocator, "a")
    step(allocator)  # copied and confirmed
    assert host_hit(allocator, PROMPT_A) == 0  # a device hit: the device holds them
    allocator.discard_uncomputed("a", 2)
    allocator.check_invariants()
    prefix = allocator.find_cached_prefix(Request("probe", PROMPT_A))
    assert prefix.num_tokens == 2  # the first block, on the device; nothing after it
    assert allocator._tiers.tier_pools[0][0].num_cached_blocks == 1


# ------------------------------------------------------------------ the engine's cadence
def test_transfers_taken_after_each_admission_copy_no_block_before_its_forward() -> None:
    # An engine that runs the transfers after each allocate_slots (kvspec-transformers,
    # the simulator) takes several times before one forward: a take must not copy a block
    # an earlier take of the same step noted, whose forward has not run.
    allocator = through(num_blocks=12, host=12)
    admit(allocator, "a", PROMPT_A)
    assert stores(step(allocator)) == []  # notes a's blocks
    admit(allocator, "b", PROMPT_B)
    assert stores(step(allocator)) == []  # a's forward has not run: nothing copied
    assert host_hit(allocator, PROMPT_A) == 0
    # The next step: a, then b, scheduled again (their forward ran): each is copied by
    # the take after its own allocation.
    a_blocks = tuple(allocator.block_ids("a")[0][:4])
    b_blocks = tuple(allocator.block_ids("b")[0][:4])
    decode(allocator, "a")
    assert stores(step(allocator)) == [(0, 1, a_blocks)]
    decode(allocator, "b")
    assert stores(step(allocator)) == [(0, 1, b_blocks)]
