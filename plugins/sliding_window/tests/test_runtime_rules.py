"""Runtime rules of the sliding-window families, registered through the plugin's hook."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import kvspec_sliding_window.plugin as sliding_window_plugin
from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.runtime import KVCacheAllocator, Request, block_tokens_of
from kvspec_core.runtime.rules import FullAttentionRules
from kvspec_sliding_window.runtime_rules import (
    KpoolTailRules,
    ReferenceSlidingWindowRules,
    SlidingWindowRules,
)
from kvspec_sliding_window.specs import (
    KpoolTailSpec,
    ReferenceSlidingWindowSpec,
    SlidingWindowSpec,
)

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
    assert plugins.runtime_rules("reference_sliding_window") is ReferenceSlidingWindowRules
    assert issubclass(ReferenceSlidingWindowRules, FullAttentionRules)


def rswa_spec(block_size: int = 4) -> ReferenceSlidingWindowSpec:
    return ReferenceSlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16, rswa_window=4
    )


def answered(allocator: KVCacheAllocator, prompt: list[int], generated: int) -> Request:
    """A request that prefilled ``prompt``, decoded ``generated`` tokens and was freed."""
    request = Request("answer", list(prompt))
    assert allocator.allocate_slots(request, len(prompt))
    for token in range(100, 100 + generated):
        request.append_token(token)
        assert allocator.allocate_slots(request, 1)
    allocator.free("answer")
    return request


@pytest.mark.parametrize("rswa", [True, False])
def test_rswa_caches_only_the_prompt_blocks(rswa: bool) -> None:
    """R-SWA's generated positions attend the prompt and the last rswa_window generated
    tokens, while the same tokens in a later prompt attend everything before them: their
    K/V differ, so a follow-up whose prompt holds the answer hits the first prompt only.
    Full attention (control) hits the answer too."""
    spec = (
        rswa_spec()
        if rswa
        else FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    )
    allocator = KVCacheAllocator([spec], 64, CTX, manager=manager())
    answer = answered(allocator, list(range(1, 11)), 22)  # prompt 10: blocks 0-1 inside it
    follow_up = Request("follow-up", [*answer.token_ids, 999])
    assert allocator.find_cached_prefix(follow_up).num_tokens == (8 if rswa else 32)
    # A prompt shorter than the first one reuses what it shares with it.
    assert allocator.find_cached_prefix(Request("short", list(range(1, 7)))).num_tokens == 4


def test_rswa_rebuilt_request_caches_up_to_its_original_prompt() -> None:
    """An engine building the request again after a preemption (its generated tokens in
    token_ids, recomputed under the decode mask) names the original prompt length."""
    allocator = KVCacheAllocator([rswa_spec()], 64, CTX, manager=manager())
    tokens = list(range(1, 31))
    resumed = Request("resumed", tokens, num_prompt_tokens=9)
    assert allocator.allocate_slots(resumed, len(tokens))
    allocator.free("resumed")
    assert allocator.find_cached_prefix(Request("again", [*tokens, 7])).num_tokens == 8
    assert allocator.usage.cached_blocks == 2


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
