"""``simulate`` with offload tiers: every transfer confirmed at once, figures per tier."""

from __future__ import annotations

import pytest
import torch

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, chat_trace
from kvspec_core.runtime.simulation import simulate


def allocator(*tiers: OffloadTier) -> KVCacheAllocator:
    spec = FullAttentionSpec(num_kv_heads=1, head_size=8, dtype=torch.float16, block_size=16)
    return KVCacheAllocator(
        [spec], 200, SizingContext(max_model_len=8192), hash_salt=b"t", offload_tiers=tiers
    )


def test_tier_figures_add_up_and_bytes_follow_the_block_bytes() -> None:
    events = list(chat_trace.make_trace(seed=0, num_requests=100))
    tiered = allocator(OffloadTier("host", 16), OffloadTier("disk", 4000))
    report = simulate(tiered, events, block_bytes=[1000])
    device, host, disk = report.tiers
    assert [device.name, host.name, disk.name] == ["device", "host", "disk"]
    assert sum(report.hit_tokens_by_tier.values()) == report.hit_tokens
    assert host.hit_tokens > 0 and disk.hit_tokens > 0
    assert host.demoted_blocks == disk.stored_blocks > 0
    for tier in report.tiers:
        assert tier.loaded_bytes == 1000 * tier.loaded_blocks
        assert tier.stored_bytes == 1000 * tier.stored_blocks
        assert tier.demoted_bytes == 1000 * tier.demoted_blocks
    tiered.check_invariants()  # nothing left pending
    alone = simulate(allocator(), events)
    assert report.hit_tokens > alone.hit_tokens
    assert alone.to_dict()["hit_tokens_by_tier"] == {"device": alone.hit_tokens}


def test_block_bytes_must_name_every_pool() -> None:
    with pytest.raises(ValueError, match="block_bytes has 2 entries for the allocator's 1 pools"):
        simulate(allocator(OffloadTier("host", 64)), [], block_bytes=[1, 2])
