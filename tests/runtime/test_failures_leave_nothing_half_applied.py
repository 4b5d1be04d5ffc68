"""Failures found by review that left a step or a confirmation half-applied.

Confirming a load with KV events hashed the request's whole token list, past what was
admitted, so a bad token not yet admitted raised half-way through ``complete_transfers``:
the load left the pending list with its tier slots and device blocks still referenced, for
good. It now hashes nothing new. A prompt-only group's ``cache_range`` was asked up to the
prompt only after the step had moved on; the preflight now asks exactly that."""

from __future__ import annotations

import pytest
import torch
from runtime_testkit import full, make_allocator

from kvspec_core.runtime import BlockStored, OffloadTier, Request


def test_a_confirmed_load_is_released_whatever_the_prompt_holds_past_the_admitted() -> None:
    allocator = make_allocator(
        [full(2)],
        6,
        offload_tiers=(OffloadTier("host", 5), OffloadTier("disk", 9)),
        enable_kv_events=True,
    )

    def serve(rid: str, tokens: list[int]) -> None:
        request = Request(rid, tokens)
        prefix = allocator.find_cached_prefix(request)
        allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
        allocator.complete_transfers([t.transfer_id for t in allocator.take_transfers()])
        allocator.free(rid)

    serve("a", list(range(9)))
    serve("b", list(range(100, 109)))  # a's blocks go to the host tier
    # A chunked prefill: one token past the 8-token tier hit; a bad token later in the prompt.
    request = Request("a2", [*range(9), "bad"])  # type: ignore[list-item]
    prefix = allocator.find_cached_prefix(request)
    assert prefix.num_tokens == 8
    assert allocator.allocate_slots(request, 1, prefix=prefix)
    allocator.take_events()
    assert allocator.complete_transfers([t.transfer_id for t in allocator.take_transfers()]) == ()
    allocator.check_invariants()
    stored = [event for event in allocator.take_events() if isinstance(event, BlockStored)]
    assert sum(len(event.block_hashes) for event in stored) == 4  # the loaded blocks
    allocator.free("a2")
    allocator.check_invariants()
    assert allocator.pools[0].num_used_blocks == 0


def test_a_prompt_only_groups_cache_range_is_asked_before_the_step_changes_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by review: R-SWA's cache_range was asked up to the prompt only after the step
    # had moved on, so a plugin raising there left the step half-applied, while the error
    # said the allocator changed nothing.
    from kvspec_core.errors import PluginError
    from kvspec_core.runtime.rules import FullAttentionRules
    from kvspec_sliding_window.runtime_rules import ReferenceSlidingWindowRules
    from kvspec_sliding_window.specs import ReferenceSlidingWindowSpec

    def cache_range(self: object, num_cached: int, num_known: int) -> tuple[int, int]:
        if (num_cached, num_known) == (2, 10):
            raise ValueError("plugin bug at (2, 10)")
        return FullAttentionRules.cache_range(self, num_cached, num_known)  # type: ignore[arg-type]

    monkeypatch.setattr(ReferenceSlidingWindowRules, "cache_range", cache_range)
    spec = ReferenceSlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, rswa_window=8
    )
    allocator = make_allocator([spec, full(4)], 40)
    request = Request("r", list(range(1, 11)))
    assert allocator.allocate_slots(request, 10)
    request.append_token(11)
    assert allocator.allocate_slots(request, 1)
    request.append_token(12)
    tables = allocator.block_ids("r")
    with pytest.raises(PluginError, match="changed nothing"):
        allocator.allocate_slots(request, 1)
    assert allocator.num_computed_tokens("r") == 11 and allocator.block_ids("r") == tables
    allocator.check_invariants()
