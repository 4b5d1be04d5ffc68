"""The uniform-type wrapper and the spec-kind registry."""

from __future__ import annotations

import pytest
import torch

from kvspec_core import (
    CrossAttentionSpec,
    FullAttentionSpec,
    MissingFamilyError,
    PluginManager,
    SinkFullAttentionSpec,
    SizingContext,
    UniformTypeSpecs,
)
from kvspec_core.errors import InvalidFieldError, UnknownNameError
from kvspec_core.specs import iter_layer_specs


def full(heads: int = 8, head: int = 128, block: int = 16, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16, **kw
    )


def test_same_type_different_shapes_share_a_uniform_group() -> None:
    registry = PluginManager().spec_kinds
    specs = {"l0": full(8, 128), "l1": full(4, 64), "l2": full(8, 128)}
    group = UniformTypeSpecs.from_specs(specs, registry)
    assert group is not None
    assert group.page_size_bytes == 65536 + 16 * 4 * 128 * 2 + 65536
    assert group.max_layers_per_page_size() == 2
    ctx = SizingContext(max_model_len=1000)
    assert group.max_blocks_per_request(ctx) == 63
    assert group.max_memory_usage_bytes(ctx) == 63 * group.page_size_bytes
    assert group.block_table_width(ctx, 1000) == 63
    assert [s for s in iter_layer_specs(group)] == list(specs.values())
    assert iter_layer_specs(full()) == (full(),)


def test_sink_counts_as_full_attention_for_uniformity() -> None:
    registry = PluginManager().spec_kinds
    specs = {
        "a": full(),
        "b": SinkFullAttentionSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
        ),
    }
    assert UniformTypeSpecs.from_specs(specs, registry) is not None


@pytest.mark.parametrize(
    "specs",
    [
        {"a": full(block=16), "b": full(block=32)},
        {"a": full(), "b": full(dcp_sharded=False)},
        {
            "a": full(),
            "b": CrossAttentionSpec(
                block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
            ),
        },
        {},
    ],
)
def test_not_uniform(specs) -> None:
    assert UniformTypeSpecs.from_specs(specs, PluginManager().spec_kinds) is None


def test_uniform_wrapper_validates_its_layers() -> None:
    with pytest.raises(InvalidFieldError, match="layer_specs"):
        UniformTypeSpecs(block_size=16, layer_specs=())
    with pytest.raises(InvalidFieldError, match="block_size"):
        UniformTypeSpecs(block_size=32, layer_specs=(("a", full()),))


def test_registry_looks_up_kinds_through_the_class_hierarchy() -> None:
    registry = PluginManager().spec_kinds

    class CustomFull(FullAttentionSpec):  # unregistered subclass keeps its parent's kind
        pass

    spec = CustomFull(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    assert registry.kind_of(spec) == "full_attention"
    assert registry.uniform_base_of(spec) is FullAttentionSpec
    assert registry.class_of("sink_full_attention") is SinkFullAttentionSpec
    assert registry.owner_of("full_attention") == "core"


def test_registry_names_the_distribution_of_a_missing_family() -> None:
    registry = PluginManager().spec_kinds
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mamba"):
        registry.class_of("mamba")
    with pytest.raises(UnknownNameError, match="known: cross_attention"):
        registry.class_of("no_such_kind")


def test_uniform_wrapper_dcp_sharding_must_match_its_layers() -> None:
    # Runtime rules read the group spec's dcp_sharded: a wrapper disagreeing with its layers
    # would size every block of a DCP-sharded group as if it held block_size positions.
    sharded = full()
    assert sharded.dcp_sharded
    with pytest.raises(InvalidFieldError, match="dcp_sharded=False"):
        UniformTypeSpecs(block_size=16, layer_specs=(("a", sharded),))
    mixed = (("a", sharded), ("b", full(dcp_sharded=False)))
    with pytest.raises(InvalidFieldError, match="dcp_sharded"):
        UniformTypeSpecs(block_size=16, dcp_sharded=True, layer_specs=mixed)
    assert UniformTypeSpecs(block_size=16, dcp_sharded=True, layer_specs=(("a", sharded),))
