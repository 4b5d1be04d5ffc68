"""A failed tier load and the requests of the same step that reused what the failed request
was to compute: ``allocate_slots`` caches a request's new blocks at its admission (before its
forward), so a request admitted after it in the same step may hit them. When the first
request's load fails it leaves the forward, its new blocks stay unwritten, and every request
that reused one must leave the forward too (``complete_transfers`` returns them all). A
forward that fails (``discard_uncomputed``) names such requests likewise. Found by the
issue-20 review (an engine taking the transfers once per step, as
``TransferRunner.run_pending`` does)."""

from __future__ import annotations

import pytest
from runtime_testkit import context, full, make_allocator, sliding

from kvspec_core.runtime import Request
from kvspec_core.runtime.tiers import LOAD, OffloadTier, TieredPrefix

PROMPT = list(range(100, 110))  # five blocks of 2 tokens


def run_transfers(allocator, fail_request=None):
    """Take the step's transfers, confirm them, fail ``fail_request``'s loads: the requests
    to leave out of the forward."""
    transfers = allocator.take_transfers()
    failing = [t.transfer_id for t in transfers if t.kind == LOAD and t.request_id == fail_request]
    allocator.complete_transfers([t.transfer_id for t in transfers if t.transfer_id not in failing])
    return allocator.complete_transfers(failing, ok=False)


def admit(allocator, rid, tokens):
    request = Request(rid, tokens)
    prefix = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
    return prefix


def offloaded(specs, **options):
    """An allocator whose device (24 blocks) evicted ``PROMPT``'s blocks into its host tier."""
    allocator = make_allocator(specs, 24, offload_tiers=(OffloadTier("host", 32),), **options)
    for rid, tokens in (("first", PROMPT), ("filler", list(range(500, 546)))):
        admit(allocator, rid, tokens)
        run_transfers(allocator)
        allocator.free(rid)
    return allocator


SPECS = {
    "full attention": ([full(2)], {}),
    "sliding window": ([sliding(2, 2)], {"ctx": context(max_model_len=64, in_flight=64)}),
}


@pytest.mark.parametrize("specs", sorted(SPECS))
def test_a_request_that_reused_a_failed_requests_new_block_leaves_the_step_too(specs) -> None:
    allocator = offloaded(SPECS[specs][0], **SPECS[specs][1])
    # One step: a loads 8 tokens from the host tier and computes 3; b, admitted after it,
    # hits a's fifth block, cached at a's admission and written only by a's forward.
    a_tokens = PROMPT[:8] + [7, 8, 9]
    assert isinstance(admit(allocator, "a", a_tokens), TieredPrefix)
    b_prefix = admit(allocator, "b", a_tokens[:10] + [1, 2, 3])
    assert b_prefix.num_tokens == 10
    a_new_block = allocator.block_ids("a")[0][4]
    assert allocator.block_ids("b")[0][4] == a_new_block
    # A bystander admitted before a, sharing nothing of a's, keeps running.
    admit(allocator, "c", list(range(700, 705)))
    assert run_transfers(allocator, fail_request="a") == ("a", "b")
    assert not allocator.is_running("a") and not allocator.is_running("b")
    assert allocator.is_running("c")
    allocator.check_invariants()
    # Nothing either was to compute is a hit now.
    assert allocator.find_cached_prefix(Request("d", a_tokens[:10] + [1, 2, 3])).num_tokens < 10


def test_the_discards_follow_reuse_from_request_to_request() -> None:
    allocator = offloaded([full(2)])
    a_tokens = PROMPT[:8] + [7, 8, 9]
    admit(allocator, "a", a_tokens)
    b_tokens = a_tokens[:10] + [1, 2, 3, 4]
    admit(allocator, "b", b_tokens)  # reuses a's fifth block, computes two more
    c_prefix = admit(allocator, "c", b_tokens[:14] + [5])  # reuses b's new blocks
    assert c_prefix.num_tokens == 14
    assert set(run_transfers(allocator, fail_request="a")) == {"a", "b", "c"}
    allocator.check_invariants()
    assert allocator.usage.used_blocks == 0


def test_holders_of_the_failed_requests_hit_keep_running() -> None:
    """The blocks of a's hit were written before this step: a request holding them (its
    forward ran) is not dropped with a."""
    allocator = make_allocator([full(2)], 16, offload_tiers=(OffloadTier("host", 16),))
    admit(allocator, "old", PROMPT[:4] + [1])  # runs on, holding PROMPT's first two blocks
    run_transfers(allocator)
    admit(allocator, "first", PROMPT)
    run_transfers(allocator)
    allocator.free("first")
    admit(allocator, "filler", list(range(500, 522)))
    run_transfers(allocator)
    allocator.free("filler")
    a_prefix = admit(allocator, "a", PROMPT[:8] + [7, 8, 9])
    assert isinstance(a_prefix, TieredPrefix)
    assert a_prefix.tokens_by_tier[0] >= 4 and a_prefix.tokens_by_tier[1] > 0
    shared = allocator.block_ids("old")[0][:2]
    assert allocator.block_ids("a")[0][:2] == shared
    assert run_transfers(allocator, fail_request="a") == ("a",)
    assert allocator.is_running("old")
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("e", PROMPT[:4] + [2])).num_tokens == 4


def test_a_failed_forward_names_the_requests_that_reused_what_it_never_wrote() -> None:
    """Without tiers too: ``discard_uncomputed`` of a request whose forward failed returns
    the requests of the step that hit its new blocks, with the tokens before the first."""
    allocator = make_allocator([full(2)], 16)
    admit(allocator, "old", PROMPT[:4] + [1])
    admit(allocator, "a", PROMPT[:8] + [7])  # reuses old's two blocks, computes two more
    admit(allocator, "b", PROMPT[:8] + [7, 8])  # reuses all four of a's
    admit(allocator, "c", [1, 2, 3])
    assert allocator.discard_uncomputed("a", 4) == {"b": 4}
    # b keeps its blocks, uncached, until the engine discards it too (nothing further).
    assert allocator.is_running("b")
    assert allocator.find_cached_prefix(Request("d", PROMPT[:8] + [7])).num_tokens == 4
    assert allocator.discard_uncomputed("b", 4) == {}
    assert allocator.is_running("old") and allocator.is_running("c")
    allocator.check_invariants()
