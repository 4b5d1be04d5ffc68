"""Runtime rules of the Mamba state family, registered through the plugin's hook."""

from __future__ import annotations

import torch

import kvspec_mamba.plugin as mamba_plugin
from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_mamba.runtime_rules import MambaRules, MambaRunningStateRules, mamba_rules
from kvspec_mamba.specs import MambaSpec

ALIGN = SizingContext(max_model_len=256, max_in_flight_tokens=64, mamba_cache_mode="align")
NONE = SizingContext(max_model_len=256, max_in_flight_tokens=64, mamba_cache_mode="none")


def state_spec(block_size: int = 4, speculative: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((2, 4),),
        dtypes=(torch.float32,),
        num_speculative_blocks=speculative,
    )


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def manager() -> PluginManager:
    fresh = PluginManager()
    fresh.register(mamba_plugin, "mamba")
    return fresh


def test_hook_registers_rules_for_the_kind() -> None:
    assert manager().runtime_rules("mamba") is mamba_rules
    assert type(mamba_rules(state_spec(), ALIGN)) is MambaRules
    assert type(mamba_rules(state_spec(), NONE)) is MambaRunningStateRules


def test_align_mode_keeps_the_start_state_and_the_running_state_only() -> None:
    spec = state_spec()
    allocator = KVCacheAllocator([spec], 16, ALIGN, manager=manager())
    request = Request("r", list(range(10)))
    assert allocator.allocate_slots(request, 10)
    table = allocator.block_ids("r")[0]
    assert table[:2] == (0, 0) and table[2]  # state at 10 lives in block (10 - 1) // 4
    for token in range(10, 30):
        request.append_token(token)
        assert allocator.allocate_slots(request, 1)
        held = [block for block in allocator.block_ids("r")[0] if block]
        assert len(held) <= spec.max_blocks_per_request(ALIGN) == 2
    # States at 12, 16, ..., 28 were saved while decoding; the cache holds them.
    assert allocator.usage.cached_blocks == 5


def test_a_prefill_past_a_boundary_saves_no_state_there() -> None:
    allocator = KVCacheAllocator(
        [full(), state_spec()], [32, 8], ALIGN, pool_of_group=[0, 1], manager=manager()
    )
    assert allocator.allocate_slots(Request("a", list(range(18))), 18)
    assert allocator.usage.cached_blocks == 4  # attention blocks only
    assert allocator.find_cached_prefix(Request("b", list(range(17)) + [0])).num_tokens == 0
    assert allocator.allocate_slots(Request("c", list(range(30))), 16)  # ends at 16
    assert allocator.find_cached_prefix(Request("d", list(range(17)) + [0])).num_tokens == 16


def test_none_mode_holds_fixed_states_and_never_caches() -> None:
    spec = state_spec(speculative=1)
    allocator = KVCacheAllocator(
        [full(), spec], [32, 8], NONE, pool_of_group=[0, 1], manager=manager()
    )
    request = Request("a", list(range(12)))
    result = allocator.allocate_slots(request, 12)
    assert [len(ids) for ids in result.new_block_ids] == [3, 2]
    for token in range(12, 20):
        request.append_token(token)
        assert allocator.allocate_slots(request, 1)
    assert len(allocator.block_ids("a")[1]) == 2
    assert allocator.usage.cached_blocks == 0
    assert allocator.find_cached_prefix(Request("b", list(range(13)))).num_tokens == 0


def test_longest_hit_returns_the_latest_saved_state() -> None:
    rules = MambaRules(state_spec(), ALIGN)
    hashes = [bytes([index]) for index in range(6)]
    cache = {hashes[1]: 7, hashes[3]: 9}
    assert rules.longest_hit(hashes, cache, 6) == [0, 0, 0, 9]
    assert rules.longest_hit(hashes, cache, 3) == [0, 7]
    assert rules.longest_hit(hashes, cache, 1) == []


def test_a_step_past_the_appended_tokens_saves_no_checkpoint() -> None:
    # 16 tokens scheduled but only 14 known (drafts): the state at 16 is not the state of
    # a known prefix, so it is not cached; attention caches its full known blocks.
    allocator = KVCacheAllocator(
        [full(), state_spec()], [32, 8], ALIGN, pool_of_group=[0, 1], manager=manager()
    )
    request = Request("a", list(range(14)))
    assert allocator.allocate_slots(request, 16)
    assert allocator.usage.cached_blocks == 3
    assert allocator.find_cached_prefix(Request("b", list(range(17)))).num_tokens == 0


def test_a_start_state_inside_a_block_is_never_cached_as_its_boundary_state() -> None:
    # Steps end at 10 and 15: block 2 holds the state at 10 when the second step starts
    # from it; it is not the state at 12 and must not be found as such.
    allocator = KVCacheAllocator(
        [full(), state_spec()], [32, 8], ALIGN, pool_of_group=[0, 1], manager=manager()
    )
    first = Request("a", list(range(20)))
    assert allocator.allocate_slots(first, 10)
    assert allocator.allocate_slots(first, 5)
    assert allocator.find_cached_prefix(Request("b", list(range(13)) + [99])).num_tokens == 0


def test_speculative_slots_beyond_the_cap_are_not_now() -> None:
    # Without speculative blocks a request holds 2 states; a step from 4 to 8 with one
    # lookahead slot would need the start state plus two more.
    allocator = KVCacheAllocator(
        [full(), state_spec()], [32, 8], ALIGN, pool_of_group=[0, 1], manager=manager()
    )
    request = Request("a", list(range(12)))
    assert allocator.allocate_slots(request, 4)
    before = allocator.block_ids("a")
    result = allocator.allocate_slots(request, 4, lookahead=1)
    assert not result and result.reason == "over_admission_cap" and result.group == 1
    assert allocator.block_ids("a") == before
    assert allocator.allocate_slots(request, 4)
