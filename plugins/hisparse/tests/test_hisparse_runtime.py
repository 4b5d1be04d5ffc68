"""The HiSparse kinds in the core's runtime allocator."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch
from hisparse_testkit import latent_like, manager_with_hisparse

from kvspec_core import SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import FullAttentionRules, KVCacheAllocator, Request, rules_for
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.full_attention import FullAttentionSpec
from kvspec_core.specs.uniform import UniformTypeSpecs
from kvspec_hisparse import HiSparseGroupSpec, HiSparseHotSpec, HiSparseResidentSpec
from kvspec_hisparse.runtime_rules import HotCacheRules, ResidentRules

CTX = SizingContext(max_model_len=2048, max_in_flight_tokens=512)


def test_hot_cache_takes_its_blocks_once_and_groups_follow_their_wrapped_spec() -> None:
    manager = manager_with_hisparse()
    source = HiSparseGroupSpec(inner=latent_like(), role="hisparse_source")
    indexer = HiSparseGroupSpec(
        inner=latent_like(head_size=64, head_size_v=64), role="hisparse_indexer"
    )
    hot = HiSparseHotSpec(block_size=64, page_size=4096, blocks_per_request=4)
    assert type(rules_for(hot, CTX, manager)) is HotCacheRules
    assert type(rules_for(source, CTX, manager)) is FullAttentionRules
    # The host-resident source has its own pool; indexer and hot share the device pool.
    allocator = KVCacheAllocator(
        [source, indexer, hot],
        [64, 64],
        CTX,
        pool_of_group=[0, 1, 1],
        manager=manager,
        hash_salt=b"hisparse-test",
    )
    request = Request("r", list(range(2048)))
    for step in range(1, 5):
        assert allocator.allocate_slots(request, 512)
        source_ids, indexer_ids, hot_ids = allocator.block_ids("r")
        assert len(source_ids) == len(indexer_ids) == step * 512 // 64
        assert len(hot_ids) == 4 and 0 not in hot_ids
    assert allocator.usage is not None
    allocator.free("r")
    allocator.check_invariants()


def test_resident_pages_keep_only_the_in_flight_window() -> None:
    manager = manager_with_hisparse()
    resident = HiSparseResidentSpec(block_size=64, page_size=4096)
    assert type(rules_for(resident, CTX, manager)) is ResidentRules
    cap = resident.max_blocks_per_request(CTX)
    assert cap == 8  # cdiv(min(512, 2048), 64)
    allocator = KVCacheAllocator([resident], 64, CTX, manager=manager, hash_salt=b"resident")
    request = Request("r", list(range(2048)))
    for _ in range(2):
        assert allocator.allocate_slots(request, 512)
        held = [block for block in allocator.block_ids("r")[0] if block != 0]
        assert len(held) == cap
    # Decode: one token at a time keeps one tail block.
    assert allocator.allocate_slots(request, 500)
    for _ in range(3):
        assert allocator.allocate_slots(request, 1)
        held = [block for block in allocator.block_ids("r")[0] if block != 0]
        assert len(held) == 1
    allocator.free("r")
    allocator.check_invariants()


@attrs.frozen(kw_only=True)
class _StateLike(KVSpec):
    """A recurrent state per block, a fixed count per request (as Mamba's, without the
    plugin: these tests import only the core and kvspec-hisparse)."""

    kind: ClassVar[str] = "hisparse_test_state"

    @property
    def num_heads(self) -> int:
        return 1

    @property
    def tokens_per_state(self) -> int:
        return -1

    @property
    def state_content_size_bytes(self) -> int:
        return 4096

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return 2


def test_a_group_wrapping_a_state_is_refused_not_given_full_attention_rules() -> None:
    """Found in review: a group wrapping a Mamba spec got full attention's rules, which cache
    every full block as if it held the state at its end; a request sharing 4 of another's 8
    tokens then resumed from a state block nothing had written."""
    manager = manager_with_hisparse()
    state = HiSparseGroupSpec(inner=_StateLike(block_size=4), role="hisparse_indexer")
    with pytest.raises(AllocatorError, match="not attention"):
        rules_for(state, CTX, manager)
    with pytest.raises(AllocatorError, match="wrap attention specs only"):
        KVCacheAllocator(
            [latent_like(block_size=4), state],
            [16, 16],
            CTX,
            pool_of_group=[0, 1],
            manager=manager,
            hash_salt=b"hisparse-test",
        )


@attrs.frozen(kw_only=True)
class _WindowLike(FullAttentionSpec):
    """Attention sized for a trailing window (as a sliding-window spec, without the plugin)."""

    kind: ClassVar[str] = "hisparse_test_window"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return 4


def test_a_group_wrapping_a_window_is_refused_not_capped_below_its_rules() -> None:
    """Found in review: a group wrapping a window spec was sized for the window but got full
    attention's rules, so every request longer than the window was over its admission cap."""
    manager = manager_with_hisparse()
    window = HiSparseGroupSpec(inner=_WindowLike(**_LATENT), role="hisparse_indexer")
    with pytest.raises(AllocatorError) as caught:
        rules_for(window, CTX, manager)
    message = str(caught.value)
    assert "'hisparse_test_window'" in message and "sized for 4 blocks" in message
    assert "keep 32" in message and "max_model_len=2,048" in message
    # The fix named is the HiSparse group's, not rules_for's (registering rules for the
    # wrapped kind does not reach a HiSparse group).
    assert "not reachable from a HiSparse group" in message
    assert "register rules" not in message
    # The same spec sized as full attention is accepted.
    full = HiSparseGroupSpec(inner=FullAttentionSpec(**_LATENT), role="hisparse_indexer")
    assert type(rules_for(full, CTX, manager)) is FullAttentionRules


_LATENT = dict(block_size=64, num_kv_heads=1, head_size=288, head_size_v=288, dtype=torch.bfloat16)


def test_a_group_wrapping_a_uniform_type_group_of_attention_layers_gets_their_rules() -> None:
    """Found in review: the usual source group (a uniform-type group of MLA layers) was
    refused as "not attention", the check reading the wrapper instead of its layers."""
    manager = manager_with_hisparse()
    layers = {f"model.layers.{i}": latent_like(block_size=4) for i in range(3)}
    wrapped = UniformTypeSpecs.from_specs(layers, manager.spec_kinds)
    assert wrapped is not None
    source = HiSparseGroupSpec(inner=wrapped, role="hisparse_source")
    assert type(rules_for(source, CTX, manager)) is FullAttentionRules
    allocator = KVCacheAllocator(
        [source, latent_like(block_size=4)],
        [16, 16],
        CTX,
        pool_of_group=[0, 1],
        manager=manager,
        hash_salt=b"hisparse-test",
    )
    first = Request("a", list(range(9)))
    assert allocator.allocate_slots(first, 9)
    allocator.free("a")
    assert allocator.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 8
