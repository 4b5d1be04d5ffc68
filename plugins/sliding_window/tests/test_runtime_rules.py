"""Runtime rules of the sliding-window families, registered through the plugin's hook."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import kvspec_sliding_window.plugin as sliding_window_plugin
from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.runtime import KVCacheAllocator, Request, block_tokens_of
from kvspec_core.runtime.rules import FullAttentionRules
from kvspec_sliding_window.runtime_rules import KpoolTailRules, SlidingWindowRules
from kvspec_sliding_window.specs import KpoolTailSpec, SlidingWindowSpec

CTX = SizingContext(max_model_len=256, max_in_flight_tokens=16)


def window_spec(window: int, block_size: int = 4, extra: int = 0) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        sliding_window=window,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        extra_retained_tokens=extra,
    )


def manager() -> PluginManager:
    fresh = PluginManager()
    fresh.register(sliding_window_plugin, "sliding_window")
    return fresh


def test_hook_registers_rules_for_the_plugins_kinds() -> None:
    plugins = manager()
    assert plugins.runtime_rules("sliding_window") is SlidingWindowRules
    assert plugins.runtime_rules("kpool_tail") is KpoolTailRules
    assert plugins.runtime_rules("reference_sliding_window") is FullAttentionRules


@settings(max_examples=60)
@given(
    window=st.integers(1, 40),
    block=st.integers(1, 8),
    extra=st.integers(0, 9),
    skipped=st.integers(0, 30),
)
def test_next_skip_position_is_where_one_more_block_is_dropped(
    window: int, block: int, extra: int, skipped: int
) -> None:
    rules = SlidingWindowRules(window_spec(window, block, extra), CTX)
    position = rules.next_skip_position(skipped)
    assert rules.skipped_tokens(position) // block == skipped + 1
    assert rules.skipped_tokens(position - 1) // block <= skipped
    assert rules.skipped_tokens(position) == max(0, position - window + 1 - extra)


@settings(max_examples=80)
@given(
    window=st.integers(1, 30),
    block=st.integers(1, 6),
    extra=st.integers(0, 5),
    cached=st.lists(st.booleans(), max_size=24),
    limit=st.integers(0, 24),
)
def test_longest_hit_is_the_largest_resumable_position(
    window: int, block: int, extra: int, cached: list[bool], limit: int
) -> None:
    rules = SlidingWindowRules(window_spec(window, block, extra), CTX)
    window += extra  # a resumed request must hold the retained tokens too
    hashes = [bytes([index]) for index in range(len(cached))]
    cache = {hashes[i]: 100 + i for i, present in enumerate(cached) if present}
    limit = min(limit, len(cached))
    hit = rules.longest_hit(hashes, cache, limit)

    def resumable(blocks: int) -> bool:
        start = max(0, blocks * block - window + 1) // block
        return all(cached[start:blocks])

    expected = max(k for k in range(limit + 1) if resumable(k))
    assert len(hit) == expected
    start = max(0, expected * block - window + 1) // block
    assert hit[:start] == [0] * start
    assert hit[start:] == [100 + i for i in range(start, expected)]


def test_a_long_request_never_holds_more_than_the_admission_cap() -> None:
    spec = window_spec(9, block_size=4, extra=2)
    allocator = KVCacheAllocator([spec], 64, CTX, manager=manager())
    cap = spec.max_blocks_per_request(CTX)
    assert allocator.admission_caps == [cap]
    request = Request("r", list(range(200)))
    computed = 0
    while computed < 200:
        assert allocator.allocate_slots(request, min(16, 200 - computed))
        computed = min(computed + 16, 200)
        held = [block for block in allocator.block_ids("r")[0] if block]
        assert len(held) <= cap
        # Every block the next step can attend to (or must retain) is still there.
        first_needed = max(0, computed - 9 + 1 - 2) // 4
        assert all(allocator.block_ids("r")[0][first_needed:])
    allocator.free("r")
    assert allocator.usage.used_blocks == 0


def test_kpool_tail_holds_one_block_for_life_and_blocks_hits() -> None:
    tail = KpoolTailSpec(
        block_size=4, sliding_window=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    allocator = KVCacheAllocator([full, tail], 64, CTX, manager=manager())
    first = Request("a", list(range(20)))
    assert allocator.allocate_slots(first, 16)
    assert allocator.allocate_slots(first, 4)
    assert len(allocator.block_ids("a")[1]) == 1
    # The tail is never cached, so no later request can resume from a prefix.
    assert allocator.find_cached_prefix(Request("b", list(range(20)))).num_tokens == 0


def test_dcp_sharded_windows_count_positions_across_ranks() -> None:
    ctx = SizingContext(max_model_len=256, max_in_flight_tokens=16, dcp_size=2)
    rules = SlidingWindowRules(window_spec(9, 4), ctx)
    assert rules.block_tokens == block_tokens_of(window_spec(9, 4), ctx) == 8
