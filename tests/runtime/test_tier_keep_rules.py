"""What the families keep below the device (``OffloadTier.keep="family_rules"`` and the
rules' optional ``offload_range``): a sliding window stores a freed request's last window
and drops the blocks it released mid-request; rules without the member keep everything;
a rule's bad answer is refused. The hybrid's no-false-hit guarantee across tiers under
these rules is checked by test_tiered_state_machine.py (keep is one of its draws)."""

from __future__ import annotations

import pytest
from runtime_testkit import full, make_allocator, sliding

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import Request
from kvspec_core.runtime.rules import StateCheckpointRules, TrailingWindowRules
from kvspec_core.runtime.tiers import KEEP_EVERYTHING, KEEP_FAMILY_RULES, OffloadTier

SPECS = [full(2), sliding(2, 5)]  # a window of 5 tokens: resuming needs 2 blocks of 2
PROMPT = list(range(13))  # six full blocks


def hybrid(keep):
    return make_allocator(SPECS, 16, offload_tiers=(OffloadTier("host", 40, keep=keep),))


def run(allocator, rid, tokens, chunk):
    """Prefill ``tokens`` in steps of ``chunk`` (transfers confirmed each step), free."""
    request = Request(rid, tokens)
    prefix = allocator.find_cached_prefix(request)
    done = prefix.num_tokens
    first = True
    while done < len(tokens):
        count = min(chunk, len(tokens) - done)
        options = {"prefix": prefix} if first else {}
        assert allocator.allocate_slots(request, count, **options)
        first = False
        done += count
        transfers = allocator.take_transfers()
        allocator.complete_transfers([t.transfer_id for t in transfers])
        allocator.check_invariants()
    allocator.free(rid)
    return prefix


def evict_everything(allocator):
    run(allocator, "b", list(range(100, 113)), 13)
    run(allocator, "c", list(range(200, 213)), 13)
    transfers = allocator.take_transfers()
    allocator.complete_transfers([t.transfer_id for t in transfers])


def host_hashes(allocator, gid):
    return set(allocator._tiers.tier_pools[0][0].caches[gid])


def test_a_sliding_window_keeps_its_last_window_and_drops_what_it_skipped() -> None:
    kept = hybrid(KEEP_FAMILY_RULES)
    everything = hybrid(KEEP_EVERYTHING)
    for allocator in (kept, everything):
        run(allocator, "a", PROMPT, 4)  # the window moves on mid-request: blocks skipped
        evict_everything(allocator)
    hashes = kept.block_hashes(Request("x", PROMPT), 1)
    assert len(hashes) == 6
    # The window group: a's last window (blocks 4 and 5) only; full attention: all six.
    assert host_hashes(kept, 1) & set(hashes) == set(hashes[4:6])
    assert host_hashes(kept, 0) >= set(hashes)
    assert host_hashes(everything, 1) >= set(hashes)
    # Resuming where a ended works from the host either way.
    for allocator in (kept, everything):
        prefix = allocator.find_cached_prefix(Request("a2", PROMPT))
        assert prefix.num_tokens == 12 and prefix.tokens_by_tier[1] == 12
    # Resuming mid-way needs a window a released mid-request: kept only with everything.
    branch = PROMPT[:8] + [99, 98, 97]
    assert everything.find_cached_prefix(Request("d", branch)).num_tokens == 8
    assert kept.find_cached_prefix(Request("d", branch)).num_tokens == 0


def test_the_default_keeps_everything() -> None:
    assert OffloadTier("host", 4).keep == KEEP_EVERYTHING
    assert hybrid(KEEP_EVERYTHING)._tiers._keep_rules == {}
    # Rules without offload_range (full attention, state checkpoints) keep everything.
    assert list(hybrid(KEEP_FAMILY_RULES)._tiers._keep_rules) == [1]
    assert not hasattr(StateCheckpointRules, "offload_range")
    assert hasattr(TrailingWindowRules, "offload_range")


@pytest.mark.parametrize("answer", [(0, 99), (3, 2), [0, 1], (0.0, 1)])
def test_a_bad_offload_range_refuses_the_free_changing_nothing(answer) -> None:
    allocator = hybrid(KEEP_FAMILY_RULES)
    request = Request("a", PROMPT)
    assert allocator.allocate_slots(request, len(PROMPT))
    allocator._tiers._keep_rules[1].offload_range = lambda num_cached: answer
    with pytest.raises(AllocatorError, match=r"offload_range\(6\)\) answered"):
        allocator.free("a")
    assert allocator.is_running("a")
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ((OffloadTier("host", 4, keep="last_window"),), "keep='last_window' is invalid"),
        (
            (OffloadTier("host", 4), OffloadTier("disk", 4, keep=KEEP_FAMILY_RULES)),
            r"offload_tiers\[1\] \('disk'\): keep='family_rules' applies",
        ),
    ],
)
def test_a_bad_keep_is_refused_naming_the_field(tiers, match) -> None:
    with pytest.raises(AllocatorError, match=match):
        make_allocator([full(2)], 6, offload_tiers=tiers)
