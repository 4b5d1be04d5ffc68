"""The engine-facing allocator: hits, decode caching, bad input, "not now", events, usage."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from runtime_testkit import Shadow, context, full, make_allocator, sliding

from kvspec_core import CrossAttentionSpec, EncoderOnlyAttentionSpec, PluginManager
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import (
    NO_FREE_BLOCKS,
    OVER_ADMISSION_CAP,
    STALE_PREFIX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheAllocator,
    NotNow,
    Request,
    rules_for,
)


def admit(allocator: KVCacheAllocator, request: Request):
    prefix = allocator.find_cached_prefix(request)
    result = allocator.allocate_slots(
        request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
    )
    return prefix, result


def test_second_request_reuses_the_shared_prefix_blocks() -> None:
    allocator = make_allocator([full(4)], 16)
    first = Request("a", list(range(10)))
    _, result = admit(allocator, first)
    assert result and [len(ids) for ids in result.new_block_ids] == [3]
    second = Request("b", list(range(8)) + [50, 51, 52])
    prefix, result = admit(allocator, second)
    assert prefix.num_tokens == 8
    tables = allocator.block_ids("a"), allocator.block_ids("b")
    assert tables[0][0][:2] == tables[1][0][:2]
    assert allocator.pools[0].ref_counts[tables[0][0][0]] == 2
    assert allocator.num_computed_tokens("b") == 11


def test_the_last_prompt_token_is_always_computed() -> None:
    allocator = make_allocator([full(4)], 16)
    admit(allocator, Request("a", list(range(8))))
    prefix, _ = admit(allocator, Request("b", list(range(8))))
    assert prefix.num_tokens == 4


def test_blocks_filled_by_decoding_are_cached() -> None:
    allocator = make_allocator([full(4)], 16)
    request = Request("a", list(range(6)))
    admit(allocator, request)
    for token in (6, 7):
        request.append_token(token)
        assert allocator.allocate_slots(request, 1)
    prefix = allocator.find_cached_prefix(Request("b", list(range(9))))
    assert prefix.num_tokens == 8


def test_free_twice_and_unknown_request_are_refused_without_change() -> None:
    allocator = make_allocator([full(4)], 16)
    admit(allocator, Request("a", list(range(6))))
    allocator.free("a")
    usage = allocator.usage
    with pytest.raises(AllocatorError, match="already freed"):
        allocator.free("a")
    with pytest.raises(AllocatorError, match="unknown"):
        allocator.free("nobody")
    assert allocator.usage == usage
    allocator.check_invariants()


def test_over_max_model_len_is_not_now_and_changes_nothing() -> None:
    allocator = make_allocator([full(4)], 64, ctx=context(max_model_len=16))
    request = Request("a", list(range(17)))
    _prefix, result = admit(allocator, request)
    assert isinstance(result, NotNow) and not result
    assert result.reason == OVER_ADMISSION_CAP and "max_model_len=16" in result.message
    assert not allocator.is_running("a") and allocator.usage.used_blocks == 0


def test_chunk_over_the_sliding_window_admission_cap_is_not_now() -> None:
    # Sliding window 4, 8 tokens in flight, blocks of 2: the cap is cdiv(3 + 8, 2) + 1 = 7.
    allocator = make_allocator([sliding(2, 4)], 64, ctx=context(in_flight=8))
    assert allocator.admission_caps == [7]
    request = Request("a", list(range(30)))
    result = allocator.allocate_slots(request, 16)
    assert isinstance(result, NotNow) and result.reason == OVER_ADMISSION_CAP
    assert result.group == 0 and "admission cap of 7" in result.message
    assert allocator.usage.used_blocks == 0
    # Chunks within the in-flight budget are admitted and old blocks are freed as it goes.
    assert allocator.allocate_slots(request, 8)
    for _ in range(2):
        assert allocator.allocate_slots(request, 8)
        held = [block for block in allocator.block_ids("a")[0] if block]
        assert len(held) <= 7


def test_short_of_blocks_is_not_now_until_something_is_freed() -> None:
    allocator = make_allocator([full(4)], 5)
    admit(allocator, Request("a", list(range(12))))
    before = allocator.usage
    blocked = Request("b", [9] * 8)
    prefix, result = admit(allocator, blocked)
    assert isinstance(result, NotNow) and result.reason == NO_FREE_BLOCKS
    assert (result.blocks_needed, result.blocks_free) == (2, 1)
    assert allocator.usage == before and not allocator.is_running("b")
    allocator.free("a")
    assert allocator.allocate_slots(blocked, 8, prefix=prefix)


def test_running_request_short_of_blocks_keeps_its_state() -> None:
    allocator = make_allocator([full(2)], 4)
    request = Request("a", [1, 2, 3, 4, 5, 6])
    assert allocator.allocate_slots(request, 6)
    request.append_token(7)
    table = allocator.block_ids("a")
    result = allocator.allocate_slots(request, 1)
    assert isinstance(result, NotNow) and result.reason == NO_FREE_BLOCKS
    assert allocator.block_ids("a") == table and allocator.num_computed_tokens("a") == 6


def test_a_prefix_whose_blocks_were_evicted_is_stale() -> None:
    allocator = make_allocator([full(4)], 4)
    admit(allocator, Request("a", list(range(9))))
    allocator.free("a")
    later = Request("b", list(range(12)))
    prefix = allocator.find_cached_prefix(later)
    assert prefix.num_tokens == 8
    admit(allocator, Request("c", [7] * 12))  # evicts a's blocks
    result = allocator.allocate_slots(later, 4, prefix=prefix)
    assert isinstance(result, NotNow) and result.reason == STALE_PREFIX
    allocator.free("c")
    assert allocator.find_cached_prefix(later).num_tokens == 0


def test_bad_arguments_are_refused() -> None:
    allocator = make_allocator([full(4)], 16)
    first, second = Request("a", list(range(8))), Request("b", list(range(8)))
    prefix = allocator.find_cached_prefix(first)
    with pytest.raises(AllocatorError, match="prefix found for request 'a'"):
        allocator.allocate_slots(second, 8, prefix=prefix)
    with pytest.raises(AllocatorError, match="num_new_tokens=-1"):
        allocator.allocate_slots(second, -1)
    assert allocator.allocate_slots(first, 8)
    with pytest.raises(AllocatorError, match="lookahead=-2"):
        allocator.allocate_slots(first, 0, lookahead=-2)
    with pytest.raises(AllocatorError, match="already running"):
        allocator.find_cached_prefix(first)
    with pytest.raises(AllocatorError, match="already running"):
        allocator.allocate_slots(first, 1, prefix=prefix)
    with pytest.raises(AllocatorError, match="is unknown"):
        allocator.block_ids("zzz")


def test_tenants_never_share_blocks() -> None:
    allocator = make_allocator([full(4)], 16)
    admit(allocator, Request("a", list(range(9)), cache_salt="tenant-1"))
    assert (
        allocator.find_cached_prefix(Request("b", list(range(9)), cache_salt="tenant-2")).num_tokens
        == 0
    )
    assert (
        allocator.find_cached_prefix(Request("c", list(range(9)), cache_salt="tenant-1")).num_tokens
        == 8
    )


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    allocator = make_allocator([full(4)], 16)
    request = Request("a", list(range(4)))
    result = allocator.allocate_slots(request, 4, lookahead=3)
    assert [len(ids) for ids in result.new_block_ids] == [2]
    assert allocator.usage.cached_blocks == 1


def test_reset_prefix_cache_forgets_hits_and_keeps_requests() -> None:
    allocator = make_allocator([full(4)], 16)
    admit(allocator, Request("a", list(range(9))))
    allocator.reset_prefix_cache()
    assert allocator.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 0
    allocator.free("a")
    allocator.check_invariants()
    assert allocator.usage.used_blocks == 0


def test_usage_reports_blocks_and_fraction() -> None:
    allocator = make_allocator([full(4)], 11)
    admit(allocator, Request("a", list(range(10))))
    usage = allocator.usage
    assert (usage.used_blocks, usage.free_blocks, usage.usable_blocks) == (3, 7, 10)
    assert usage.fraction == pytest.approx(0.3)
    assert usage.cached_blocks == 2


def test_kv_events_per_group() -> None:
    allocator = make_allocator([full(2), sliding(2, 3)], 9, enable_kv_events=True)
    admit(allocator, Request("a", [1, 2, 3, 4]))
    events = allocator.take_events()
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert [event.group for event in stored] == [0, 1]
    assert stored[0].token_ids == (1, 2, 3, 4) and stored[0].parent_block_hash is None
    assert allocator.take_events() == []
    allocator.free("a")
    admit(allocator, Request("b", [9, 9, 9, 9, 9, 9, 9, 9]))
    assert any(isinstance(event, BlockRemoved) for event in allocator.take_events())
    allocator.reset_prefix_cache()
    assert allocator.take_events()[-1] == AllBlocksCleared()


def test_prefix_caching_off_never_hits() -> None:
    allocator = make_allocator([full(4)], 16, enable_prefix_caching=False)
    admit(allocator, Request("a", list(range(9))))
    assert allocator.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 0
    assert allocator.usage.cached_blocks == 0


def test_hash_granularity_finer_than_the_page() -> None:
    allocator = make_allocator([full(8), sliding(4, 5)], 40, ctx=context(in_flight=32))
    assert allocator.hash_block_size == 4
    admit(allocator, Request("a", list(range(20))))
    prefix = allocator.find_cached_prefix(Request("b", list(range(17)) + [99]))
    assert prefix.num_tokens == 16  # a multiple of both pages, from 4-token hashes
    with pytest.raises(AllocatorError, match="must divide group 0"):
        make_allocator([full(8)], 40, hash_block_size=3)


def test_cross_attention_holds_encoder_blocks_and_never_resumes() -> None:
    attention = dict(num_kv_heads=1, head_size=8, dtype=torch.float16, block_size=4)
    specs = [full(4), CrossAttentionSpec(**attention), EncoderOnlyAttentionSpec(**attention)]
    ctx = context(max_model_len=64).__class__(max_model_len=64, max_encoder_tokens=12)
    allocator = KVCacheAllocator(specs, 32, ctx, manager=PluginManager())
    request = Request("a", list(range(9)), num_encoder_tokens=10)
    _, result = admit(allocator, request)
    assert [len(ids) for ids in result.new_block_ids] == [3, 3, 0]
    request.append_token(1)
    assert allocator.allocate_slots(request, 1)
    assert allocator.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 0
    too_long = Request("c", [1], num_encoder_tokens=13)
    assert allocator.allocate_slots(too_long, 1).reason == OVER_ADMISSION_CAP


def test_from_plan_reads_groups_and_pools() -> None:
    plan = types.SimpleNamespace(
        groups=[types.SimpleNamespace(spec=full(16), block_size=4, pool=0)],
        pools=[types.SimpleNamespace(num_blocks=9)],
        context=context(),
    )
    allocator = KVCacheAllocator.from_plan(plan, PluginManager())
    assert allocator.specs[0].block_size == 4 and allocator.pools[0].num_blocks == 9
    plan.groups[0].blocks_per_request = 99  # sized under another context
    with pytest.raises(AllocatorError, match="sized for 99 blocks"):
        KVCacheAllocator.from_plan(plan, PluginManager())
    with pytest.raises(AllocatorError, match="SizingContext"):
        KVCacheAllocator.from_plan(types.SimpleNamespace(groups=[], pools=[]), PluginManager())


def test_kinds_without_rules_use_their_nearest_ancestors() -> None:
    import attrs
    from runtime_testkit import manager_with_families

    from kvspec_sliding_window.specs import SlidingWindowSpec

    @attrs.frozen(kw_only=True)
    class VendorWindowSpec(SlidingWindowSpec):
        kind = "vendor_window"  # type: ignore[assignment]

    spec = VendorWindowSpec(
        block_size=2, sliding_window=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    rules = rules_for(spec, context(), manager_with_families())
    assert type(rules).__name__ == "SlidingWindowRules"
    assert type(rules_for(full(2), context(), None)).__name__ == "FullAttentionRules"


def test_shadow_checks_hits_of_a_simple_replay() -> None:
    allocator = make_allocator([full(2), sliding(2, 3)], 30)
    shadow = Shadow(allocator)
    for index in range(6):
        request = Request(index, [1, 2, 3, 4, 5, 6, index])
        prefix = allocator.find_cached_prefix(request)
        shadow.check_hit(request, prefix)
        result = allocator.allocate_slots(request, 7 - prefix.num_tokens, prefix=prefix)
        shadow.record(request, result)
        assert prefix.num_tokens == (0 if index == 0 else 6)


def test_invalid_construction_is_refused() -> None:
    ctx = context()
    manager = PluginManager()
    with pytest.raises(AllocatorError, match="at least one"):
        KVCacheAllocator([], 8, ctx, manager=manager)
    with pytest.raises(AllocatorError, match="is not a KVSpec"):
        KVCacheAllocator(["full"], 8, ctx, manager=manager)  # type: ignore[list-item]
    with pytest.raises(AllocatorError, match="SizingContext"):
        KVCacheAllocator([full(4)], 8, {"max_model_len": 8}, manager=manager)  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match="names pool 1"):
        KVCacheAllocator([full(4)], 8, ctx, pool_of_group=[1], manager=manager)
    with pytest.raises(AllocatorError, match="2 entries for 1 groups"):
        KVCacheAllocator([full(4)], 8, ctx, pool_of_group=[0, 0], manager=manager)
    with pytest.raises(AllocatorError, match="num_blocks=1"):
        KVCacheAllocator([full(4)], 1, ctx, manager=manager)


def test_a_deep_copy_is_an_independent_allocator_in_the_same_state() -> None:
    allocator = make_allocator([full(2), sliding(2, 5)], 40)
    first = Request("a", [1, 2, 3, 4, 5, 6, 7])
    allocator.allocate_slots(first, 7, prefix=allocator.find_cached_prefix(first))
    second = Request("b", [1, 2, 3, 4, 9])
    allocator.allocate_slots(second, 5 - 4, prefix=allocator.find_cached_prefix(second))
    allocator.free("a")
    twin = copy.deepcopy(allocator)
    twin_second = twin._running["b"].request
    assert twin.usage == allocator.usage
    assert twin.block_ids("b") == allocator.block_ids("b")
    # Both go on alike, and neither sees the other's steps.
    for request in (second, twin_second):
        request.append_token(8)
    assert allocator.allocate_slots(second, 1) == twin.allocate_slots(twin_second, 1)
    assert twin.num_computed_tokens("b") == allocator.num_computed_tokens("b") == 6
    twin.free("b")
    assert allocator.is_running("b") and not twin.is_running("b")
    allocator.check_invariants()
    twin.check_invariants()
