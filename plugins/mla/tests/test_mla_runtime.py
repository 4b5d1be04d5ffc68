"""The MLA kinds in the core's runtime allocator: what each group holds step by step."""

from __future__ import annotations

import torch
from mla_testkit import latent_fields, manager_with_mla

from kvspec_core import SizingContext
from kvspec_core.runtime import FullAttentionRules, KVCacheAllocator, Request, rules_for
from kvspec_mla import CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec
from kvspec_mla.runtime_rules import CircularBufferRules
from kvspec_sliding_window.runtime_rules import SlidingWindowRules

CTX = SizingContext(max_model_len=4096, max_in_flight_tokens=256)


def _groups() -> list:
    return [
        MLAAttentionSpec(**latent_fields()),
        CircularBufferSpec(block_size=16, num_kv_heads=1, head_size=512, dtype=torch.bfloat16),
        SlidingWindowMLASpec(**latent_fields(sliding_window=128)),
    ]


def test_each_kind_gets_its_rules_with_only_the_core_and_mla_loaded() -> None:
    manager = manager_with_mla()
    mla, ring, swa = _groups()
    assert type(rules_for(mla, CTX, manager)) is FullAttentionRules
    assert type(rules_for(ring, CTX, manager)) is CircularBufferRules
    assert type(rules_for(swa, CTX, manager)) is SlidingWindowRules


def test_groups_hold_what_their_admission_caps_say() -> None:
    specs = _groups()
    caps = [spec.max_blocks_per_request(CTX) for spec in specs]
    assert caps == [256, 1, 25]  # cdiv(4096, 16); one ring block; cdiv(127 + 256, 16) + 1
    allocator = KVCacheAllocator(
        specs, 1000, CTX, manager=manager_with_mla(), hash_salt=b"mla-test"
    )
    request = Request("r", list(range(4096)))
    computed = 0
    held: list[list[int]] = [[], [], []]
    while computed < 4096:
        result = allocator.allocate_slots(request, 256)
        assert result, result
        computed += 256
        for group, ids in enumerate(allocator.block_ids("r")):
            held[group].append(sum(1 for block in ids if block != 0))
    assert held[0] == [tokens // 16 for tokens in range(256, 4097, 256)]
    assert set(held[1]) == {1}
    assert max(held[2]) <= caps[2] and held[2][-1] >= 128 // 16
    allocator.free("r")
    allocator.check_invariants()
