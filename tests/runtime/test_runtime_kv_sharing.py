"""The runtime allocates nothing for layers that read another layer's cache: an allocator
from a plan with readers is the allocator of the plan without them, block for block, and
admits exactly the plan's concurrency."""

from __future__ import annotations

import math

import torch

from kvspec_core import PluginManager, SizingContext
from kvspec_core.planner import plan_kv_cache
from kvspec_core.runtime import NO_FREE_BLOCKS, KVCacheAllocator, Request
from kvspec_core.specs import FullAttentionSpec, KVSharingSpec, KVSpec

CTX = SizingContext(max_model_len=256, max_in_flight_tokens=64)


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)


def _model(readers: int) -> dict[str, KVSpec]:
    """Three layers holding a cache, then ``readers`` layers reading the last one's."""
    specs: dict[str, KVSpec] = {f"layers.{i}": _full() for i in range(3)}
    for index in range(3, 3 + readers):
        specs[f"layers.{index}"] = KVSharingSpec(target_layer="layers.2", reader_spec=_full())
    return specs


def _run(allocator: KVCacheAllocator, requests: int) -> list[object]:
    """Prefill ``requests`` max-length requests in steps of 64 tokens, decode nothing; every
    result the allocator gives, in order."""
    results: list[object] = []
    for request_id in range(requests):
        request = Request(request_id, [request_id + 1] * CTX.max_model_len)
        for _ in range(CTX.max_model_len // 64):
            results.append(allocator.allocate_slots(request, 64))
    return results


def test_readers_cost_the_allocator_nothing() -> None:
    page = 16 * 2 * 16 * 2
    budget = 3 * 16 * 3 * page + 3 * page + 7 * page  # 3 requests and some blocks to spare
    plan = plan_kv_cache(_model(readers=5), budget, CTX, PluginManager())
    alone = plan_kv_cache(_model(readers=0), budget, CTX, PluginManager())
    assert plan.memoryless_layers == tuple(f"layers.{i}" for i in range(3, 8))
    allocator = KVCacheAllocator.from_plan(plan, PluginManager())
    reference = KVCacheAllocator.from_plan(alone, PluginManager())
    assert len(allocator.specs) == len(plan.groups) == 1
    assert not any(isinstance(spec, KVSharingSpec) for spec in allocator.specs)
    assert [pool.num_blocks for pool in plan.pools] == [pool.num_blocks for pool in alone.pools]
    results = _run(allocator, 4)
    assert results == _run(reference, 4)
    assert allocator.usage == reference.usage
    # The plan's concurrency is exact for full attention: 3 fit, the 4th is refused.
    assert math.floor(plan.max_concurrency) == 3
    admitted = [result for result in results if result]
    assert len(admitted) == 3 * 4
    assert results[12].reason == NO_FREE_BLOCKS  # type: ignore[attr-defined]
    # A reader's block table is its source's group's: blocks are shared, none of its own.
    group = plan.cache_group_of("layers.6").id
    assert allocator.block_ids(0)[group] == reference.block_ids(0)[group]
    assert len(allocator.block_ids(0)[group]) == CTX.max_model_len // 16
