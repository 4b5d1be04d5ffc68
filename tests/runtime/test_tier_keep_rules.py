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


# ------------------------------------------------------------------ every path that frees
def snapshot(allocator):
    """What a refused call must leave as it was."""
    return (
        [dict(cache) for cache in allocator._caches],
        [list(pool._block_hash) for pool in allocator.pools],
        [list(pool.ref_counts) for pool in allocator.pools],
        sorted(map(str, allocator._running)),
        sorted(allocator._tiers._pending),
        [dict(kept) for kept in allocator._tiers._kept],
    )


def plugin_bug(num_cached):
    raise ZeroDivisionError("a plugin's bug")


@pytest.mark.parametrize("rule", [lambda num_cached: (0, 99), plugin_bug])
def test_a_bad_offload_range_refuses_discard_uncomputed_changing_nothing(rule) -> None:
    allocator = hybrid(KEEP_FAMILY_RULES)
    assert allocator.allocate_slots(Request("a", PROMPT), len(PROMPT))
    good = allocator._tiers._keep_rules[1].offload_range
    allocator._tiers._keep_rules[1].offload_range = rule
    before = snapshot(allocator)
    with pytest.raises(AllocatorError, match=r"group 1's rules \(.*offload_range\(6\)\)"):
        allocator.discard_uncomputed("a", 4)
    assert snapshot(allocator) == before  # nothing uncached, the request still runs
    allocator.check_invariants()
    allocator._tiers._keep_rules[1].offload_range = good
    allocator.discard_uncomputed("a", 4)
    assert not allocator.is_running("a")
    assert allocator.find_cached_prefix(Request("p", PROMPT)).num_tokens == 4


def loads_failing_for_two_requests():
    """Two requests admitted with loads from the host (their transfers taken, the stores
    confirmed): the loads, not completed yet."""
    allocator = make_allocator(
        SPECS, 30, offload_tiers=(OffloadTier("host", 80, keep="family_rules"),)
    )
    prompts = {"r1": list(range(13)), "r2": list(range(300, 313))}
    for rid, tokens in [("p1", prompts["r1"]), ("p2", prompts["r2"])] + [
        (f"f{i}", list(range(1000 + 100 * i, 1013 + 100 * i))) for i in range(6)
    ]:
        run(allocator, rid, tokens, 13)
    transfers = allocator.take_transfers()
    allocator.complete_transfers([t.transfer_id for t in transfers])
    for rid, tokens in prompts.items():
        request = Request(rid, tokens + [50])
        prefix = allocator.find_cached_prefix(request)
        assert prefix.tokens_by_tier[1] > 0
        assert allocator.allocate_slots(
            request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
        )
    transfers = allocator.take_transfers()
    allocator.complete_transfers([t.transfer_id for t in transfers if t.kind != "load"])
    loads = [t.transfer_id for t in transfers if t.kind == "load"]
    assert {t.request_id for t in transfers if t.kind == "load"} == {"r1", "r2"}
    return allocator, loads


@pytest.mark.parametrize("rule", [lambda num_cached: (0, 99), plugin_bug])
def test_a_bad_offload_range_refuses_failed_loads_changing_nothing(rule) -> None:
    allocator, loads = loads_failing_for_two_requests()
    good = allocator._tiers._keep_rules[1].offload_range
    allocator._tiers._keep_rules[1].offload_range = rule
    before = snapshot(allocator)
    with pytest.raises(AllocatorError, match=r"group 1's rules"):
        allocator.complete_transfers(loads, ok=False)
    # Nothing half-applied: the loads are still pending (the engine can report them
    # again), both requests still run, nothing was uncached.
    assert snapshot(allocator) == before
    allocator.check_invariants()
    allocator._tiers._keep_rules[1].offload_range = good
    assert sorted(allocator.complete_transfers(loads, ok=False)) == ["r1", "r2"]
    assert not allocator.is_running("r1") and not allocator.is_running("r2")
    allocator.check_invariants()


def test_an_offload_range_that_raises_refuses_the_free_naming_the_group() -> None:
    allocator = hybrid(KEEP_FAMILY_RULES)
    assert allocator.allocate_slots(Request("a", PROMPT), len(PROMPT))
    allocator._tiers._keep_rules[1].offload_range = plugin_bug
    with pytest.raises(AllocatorError, match=r"group 1's rules .* raised ZeroDivisionError"):
        allocator.free("a")
    assert allocator.is_running("a")
    allocator.check_invariants()


def test_an_offload_range_that_is_not_a_method_is_refused_when_the_allocator_is_built(
    monkeypatch,
) -> None:
    rules_class = type(hybrid(KEEP_FAMILY_RULES)._tiers._keep_rules[1])
    monkeypatch.setattr(rules_class, "offload_range", (0, 1))  # an attribute, not a method
    with pytest.raises(
        AllocatorError,
        match=rf"group 1's rules \({rules_class.__name__}\): offload_range=\(0, 1\) is not "
        r"callable.*define it as a method",
    ):
        hybrid(KEEP_FAMILY_RULES)
    # Not asked with the default keep: not checked either.
    hybrid(KEEP_EVERYTHING)
