"""Runtime rules of chunked local attention, registered through the plugin's hook."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import kvspec_chunked_local.plugin as chunked_plugin
from kvspec_chunked_local.runtime_rules import ChunkedLocalRules
from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec
from kvspec_core import PluginManager, SizingContext
from kvspec_core.runtime import KVCacheAllocator, Request

CTX = SizingContext(max_model_len=256, max_in_flight_tokens=16)


def chunk_spec(chunk: int, block_size: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        attention_chunk_size=chunk,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
    )


def manager() -> PluginManager:
    fresh = PluginManager()
    fresh.register(chunked_plugin, "chunked_local")
    return fresh


def test_hook_registers_rules_for_the_kind() -> None:
    assert manager().runtime_rules("chunked_local_attention") is ChunkedLocalRules


@settings(max_examples=60)
@given(chunk=st.integers(1, 40), block=st.integers(1, 8), skipped=st.integers(0, 30))
def test_next_skip_position_is_where_one_more_block_is_dropped(
    chunk: int, block: int, skipped: int
) -> None:
    rules = ChunkedLocalRules(chunk_spec(chunk, block), CTX)
    position = rules.next_skip_position(skipped)
    assert rules.skipped_tokens(position) // block > skipped
    assert rules.skipped_tokens(position - 1) // block <= skipped


@settings(max_examples=80)
@given(
    chunk=st.integers(1, 20),
    block=st.integers(1, 6),
    cached=st.lists(st.booleans(), max_size=24),
    limit=st.integers(0, 24),
)
def test_longest_hit_is_the_largest_resumable_position(
    chunk: int, block: int, cached: list[bool], limit: int
) -> None:
    rules = ChunkedLocalRules(chunk_spec(chunk, block), CTX)
    hashes = [bytes([index]) for index in range(len(cached))]
    cache = {hashes[i]: 100 + i for i, present in enumerate(cached) if present}
    limit = min(limit, len(cached))
    hit = rules.longest_hit(hashes, cache, limit)

    def first_needed(blocks: int) -> int:
        return blocks * block // chunk * chunk // block

    expected = max(k for k in range(limit + 1) if all(cached[first_needed(k) : k]))
    assert len(hit) == expected
    start = first_needed(expected)
    assert hit[:start] == [0] * start
    assert hit[start:] == [100 + i for i in range(start, expected)]


def test_a_long_request_holds_its_chunk_within_the_cap() -> None:
    spec = chunk_spec(8, block_size=4)
    allocator = KVCacheAllocator([spec], 64, CTX, manager=manager())
    request = Request("r", list(range(100)))
    for _ in range(6):
        assert allocator.allocate_slots(request, 16)
        assert sum(
            1 for block in allocator.block_ids("r")[0] if block
        ) <= spec.max_blocks_per_request(CTX)
    computed = allocator.num_computed_tokens("r")
    table = allocator.block_ids("r")[0]
    assert all(table[computed // 8 * 8 // 4 :]) and not any(table[: computed // 8 * 8 // 4 - 4])
