"""Worked examples for the HiSparse specs, group roles and host-pool sizing."""

from __future__ import annotations

import attrs
import pytest
import torch
from hisparse_testkit import latent_like, manager_with_hisparse

from kvspec_core import SizingContext
from kvspec_core.errors import (
    CapacityError,
    InvalidFieldError,
    InvalidFieldTypeError,
    MergeError,
    PlanError,
)
from kvspec_core.specs import UniformTypeSpecs, spec_from_dict, spec_to_dict
from kvspec_hisparse import (
    HiSparseGroupSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    min_host_blocks,
    size_host_pool,
    size_host_pool_for_specs,
)

LATENT_PAGE = 64 * 576 * 2  # 73,728 bytes: one bf16 latent page of 64 tokens


# --------------------------------------------------------------------------- hot cache
@pytest.mark.parametrize(
    "max_len, in_flight, dcp",
    [(1, 1, 1), (4096, 16384, 1), (163840, 16384, 2), (1 << 30, 1 << 20, 8)],
)
def test_hot_cache_holds_a_fixed_number_of_blocks(max_len: int, in_flight: int, dcp: int) -> None:
    hot = HiSparseHotSpec(block_size=64, page_size=LATENT_PAGE, blocks_per_request=33)
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight, dcp_size=dcp)
    assert hot.page_size_bytes == hot.unpadded_page_size_bytes == LATENT_PAGE
    assert hot.max_blocks_per_request(ctx) == 33
    assert hot.max_memory_usage_bytes(ctx) == 33 * LATENT_PAGE
    assert hot.block_table_width(ctx, max_len) == 33


def test_hot_cache_runtime_properties() -> None:
    hot = HiSparseHotSpec(block_size=64, page_size=2048, blocks_per_request=4)
    assert hot.block_table_token_alignment is None
    assert (hot.uses_slot_mapping, hot.has_layer_views, hot.prefix_cacheable) == (
        False,
        False,
        False,
    )
    assert (hot.host_resident, hot.group_role, hot.transferable) == (False, "default", False)
    assert hot.num_states == 1 and hot.num_heads == 1


# --------------------------------------------------------------------------- resident pages
@pytest.mark.parametrize(
    "max_len, in_flight, block, blocks",
    [
        (163840, 16384, 64, 256),  # cdiv(min(16384, 163840), 64)
        (1000, 16384, 64, 16),  # capped by max_model_len: cdiv(1000, 64)
        (163840, 1, 64, 1),
        (163840, 8193, 16, 513),  # cdiv(8193, 16)
        (5, 5, 1, 5),
    ],
)
def test_resident_admission_cap(max_len: int, in_flight: int, block: int, blocks: int) -> None:
    resident = HiSparseResidentSpec(block_size=block, page_size=LATENT_PAGE)
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight)
    assert resident.max_blocks_per_request(ctx) == blocks
    assert resident.max_memory_usage_bytes(ctx) == blocks * LATENT_PAGE


def test_resident_runtime_properties_and_width() -> None:
    resident = HiSparseResidentSpec(block_size=64, page_size=2048)
    ctx = SizingContext(max_model_len=163840)
    assert resident.block_table_width(ctx, 163840) == 2560
    assert resident.block_table_width(ctx, 163841) == 2561
    assert (resident.prefix_cacheable, resident.has_layer_views, resident.transferable) == (
        False,
        False,
        False,
    )
    assert (resident.uses_slot_mapping, resident.block_table_token_alignment) == (True, 128)


@pytest.mark.parametrize(
    "cls, overrides, field, error",
    [
        (HiSparseHotSpec, {"page_size": 0}, "page_size", InvalidFieldError),
        (HiSparseHotSpec, {"page_size": 2048.0}, "page_size", InvalidFieldTypeError),
        (HiSparseHotSpec, {"blocks_per_request": 0}, "blocks_per_request", InvalidFieldError),
        (
            HiSparseHotSpec,
            {"blocks_per_request": True},
            "blocks_per_request",
            InvalidFieldTypeError,
        ),
        (HiSparseResidentSpec, {"page_size": -1}, "page_size", InvalidFieldError),
        (HiSparseResidentSpec, {"block_size": 0}, "block_size", InvalidFieldError),
    ],
)
def test_invalid_fields_are_refused(cls: type, overrides: dict, field: str, error: type) -> None:
    fields = {"block_size": 64, "page_size": 2048}
    if cls is HiSparseHotSpec:
        fields["blocks_per_request"] = 4
    with pytest.raises(error) as caught:
        cls(**{**fields, **overrides})
    assert caught.value.field == field and cls.__name__ in str(caught.value)


def test_merge_and_uniformity_of_device_pages() -> None:
    registry = manager_with_hisparse().spec_kinds
    hot = HiSparseHotSpec(block_size=64, page_size=2048, blocks_per_request=4)
    resident = HiSparseResidentSpec(block_size=64, page_size=2048)
    assert HiSparseHotSpec.merge([hot, hot], ["a.hot", "b.hot"]) == hot
    assert HiSparseResidentSpec.merge([resident] * 3, ["a", "b", "c"]) == resident
    with pytest.raises(MergeError) as caught:
        HiSparseHotSpec.merge([hot, attrs.evolve(hot, blocks_per_request=8)], ["l0.hot", "l1.hot"])
    message = str(caught.value)
    assert "'blocks_per_request'" in message and "4 in l0.hot" in message
    assert "8 in l1.hot" in message
    assert UniformTypeSpecs.is_uniform_type({"a": hot, "b": hot}, registry)
    assert not UniformTypeSpecs.is_uniform_type({"a": hot, "b": resident}, registry)
    assert not UniformTypeSpecs.is_uniform_type({"a": resident, "b": hot}, registry)


# --------------------------------------------------------------------------- group roles
def test_source_group_is_host_resident_transferable_and_sized_like_its_layers() -> None:
    inner = latent_like()
    source = HiSparseGroupSpec(inner=inner, role="hisparse_source")
    indexer = HiSparseGroupSpec(
        inner=latent_like(head_size=64, head_size_v=64), role="hisparse_indexer"
    )
    assert (source.host_resident, source.group_role, source.transferable) == (
        True,
        "hisparse_source",
        True,
    )
    assert (indexer.host_resident, indexer.group_role, indexer.transferable) == (
        False,
        "hisparse_indexer",
        True,
    )
    assert (source.block_size, source.dcp_sharded) == (64, True)
    assert source.page_size_bytes == inner.page_size_bytes == LATENT_PAGE
    assert source.view_dtype == torch.bfloat16 and source.num_states == 64
    for max_len, dcp in [(1, 1), (163840, 1), (163840, 4)]:
        ctx = SizingContext(max_model_len=max_len, dcp_size=dcp)
        assert source.max_blocks_per_request(ctx) == inner.max_blocks_per_request(ctx)
        assert source.max_memory_usage_bytes(ctx) == inner.max_memory_usage_bytes(ctx)
        assert source.block_table_width(ctx, max_len) == inner.block_table_width(ctx, max_len)
    assert (source.prefix_cacheable, source.uses_slot_mapping) == (True, True)


def test_group_wraps_a_uniform_type_group_of_layers() -> None:
    registry = manager_with_hisparse().spec_kinds
    layers = {f"model.layers.{i}": latent_like() for i in range(27)}
    wrapped = UniformTypeSpecs.from_specs(layers, registry)
    assert wrapped is not None
    source = HiSparseGroupSpec(inner=wrapped, role="hisparse_source")
    assert source.page_size_bytes == 27 * LATENT_PAGE
    ctx = SizingContext(max_model_len=163840)
    assert source.max_blocks_per_request(ctx) == 2560
    assert spec_from_dict(spec_to_dict(source), registry) == source


def test_group_field_refusals() -> None:
    with pytest.raises(InvalidFieldError) as caught:
        HiSparseGroupSpec(inner=latent_like(), role="hisparse_hot")
    assert caught.value.field == "role"
    with pytest.raises(InvalidFieldError) as caught:
        HiSparseGroupSpec(inner=latent_like(), role="hisparse_source", block_size=16)
    assert caught.value.field == "block_size" and "64" in str(caught.value)
    with pytest.raises(InvalidFieldTypeError) as caught:
        HiSparseGroupSpec(
            inner=HiSparseHotSpec(block_size=64, page_size=1, blocks_per_request=1),
            role="hisparse_source",
        )
    assert caught.value.field == "inner"
    # Not a spec at all: refused by name too, not an AttributeError from its defaults.
    for bad in (3, None, "mla"):
        with pytest.raises(InvalidFieldTypeError) as caught:
            HiSparseGroupSpec(inner=bad, role="hisparse_source")  # type: ignore[arg-type]
        assert caught.value.field == "inner"


def test_group_merge() -> None:
    source = HiSparseGroupSpec(inner=latent_like(), role="hisparse_source")
    assert HiSparseGroupSpec.merge([source, source], ["l0", "l1"]) == source
    indexer = attrs.evolve(source, role="hisparse_indexer")
    with pytest.raises(MergeError) as caught:
        HiSparseGroupSpec.merge([source, indexer, source], ["l0", "l1", "l2"])
    message = str(caught.value)
    assert "'role'" in message and "'hisparse_source' in l0, l2" in message
    assert "'hisparse_indexer' in l1" in message
    other = HiSparseGroupSpec(inner=latent_like(dtype=torch.float16), role="hisparse_source")
    with pytest.raises(MergeError) as caught:
        HiSparseGroupSpec.merge([source, other], ["l0", "l1"])
    assert "'dtype'" in str(caught.value) and "l1" in str(caught.value)


def test_group_uniformity_and_block_size_change() -> None:
    registry = manager_with_hisparse().spec_kinds
    source = HiSparseGroupSpec(inner=latent_like(), role="hisparse_source")
    wide = HiSparseGroupSpec(
        inner=latent_like(head_size=512, head_size_v=512), role="hisparse_source"
    )
    indexer = attrs.evolve(source, role="hisparse_indexer")
    hot = HiSparseHotSpec(block_size=64, page_size=2048, blocks_per_request=4)
    assert UniformTypeSpecs.is_uniform_type({"a": source, "b": wide}, registry)
    assert not UniformTypeSpecs.is_uniform_type({"a": source, "b": indexer}, registry)
    assert not UniformTypeSpecs.is_uniform_type({"a": source, "b": hot}, registry)
    smaller = source.with_block_size(16)
    assert (smaller.block_size, smaller.inner.block_size) == (16, 16)
    assert smaller.page_size_bytes == 16 * 576 * 2


# --------------------------------------------------------------------------- host pool
def test_host_pool_worked_example() -> None:
    # 27 fp8_ds_mla layers of 64 tokens: 27 x 64 x 656 B per host block.
    page = 64 * 656
    pool = size_host_pool(64 << 30, [page] * 27)
    assert pool.block_stride_bytes == pool.page_bytes == 27 * page == 1133568
    assert pool.num_blocks == (64 << 30) // 1133568 == 60622
    assert pool.pool_bytes == 60622 * 1133568 and pool.padding_bytes == 0
    assert pool.unused_bytes == (64 << 30) - pool.pool_bytes
    aligned = size_host_pool(64 << 30, [page] * 27, alignment=4096)
    assert aligned.block_stride_bytes == 1134592  # 277 x 4096
    assert aligned.num_blocks == (64 << 30) // 1134592 == 60567
    assert aligned.padding_bytes == 60567 * (1134592 - 1133568)


def test_host_pool_refuses_a_budget_below_one_block_naming_bytes() -> None:
    assert size_host_pool(4096, [4096]).num_blocks == 1
    with pytest.raises(CapacityError) as caught:
        size_host_pool(4095, [4096])
    message = str(caught.value)
    assert "4095 bytes" in message and "4096 bytes" in message
    with pytest.raises(CapacityError, match="needs: 3 block"):
        size_host_pool(3 * 1000 - 1, [600, 400], min_blocks=3)


@pytest.mark.parametrize(
    "kwargs, field, error",
    [
        ({"host_budget_bytes": -1}, "host_budget_bytes", InvalidFieldError),
        ({"host_budget_bytes": 1.5}, "host_budget_bytes", InvalidFieldTypeError),
        ({"page_sizes": []}, "page_sizes", InvalidFieldError),
        ({"page_sizes": [4096, 0]}, "page_sizes", InvalidFieldError),
        ({"page_sizes": 4096}, "page_sizes", InvalidFieldError),
        ({"alignment": 0}, "alignment", InvalidFieldError),
        ({"alignment": True}, "alignment", InvalidFieldTypeError),
        ({"min_blocks": 0}, "min_blocks", InvalidFieldError),
    ],
)
def test_host_pool_refuses_invalid_arguments(kwargs: dict, field: str, error: type) -> None:
    arguments = {"host_budget_bytes": 1 << 20, "page_sizes": [4096], **kwargs}
    with pytest.raises(error) as caught:
        size_host_pool(**arguments)
    assert caught.value.field == field


def test_host_pool_for_plan_groups() -> None:
    source = HiSparseGroupSpec(
        inner=latent_like(block_stride_alignment=4096), role="hisparse_source"
    )
    indexer = HiSparseGroupSpec(
        inner=latent_like(head_size=64, head_size_v=64), role="hisparse_indexer"
    )
    hot = HiSparseHotSpec(block_size=64, page_size=2048, blocks_per_request=4)
    pool = size_host_pool_for_specs(1 << 30, [source, indexer, hot], alignment=5)
    # Only the source is on the host; stride aligned to lcm(5, 4096) = 20480.
    assert pool.page_bytes == LATENT_PAGE
    assert pool.block_stride_bytes == 81920  # round_up(73728, 20480) = 4 x 20480
    assert pool.num_blocks == (1 << 30) // 81920 == 13107
    ctx = SizingContext(max_model_len=163840)
    assert min_host_blocks(ctx, [64]) == 2562
    assert size_host_pool_for_specs(2562 * 81920, [source], alignment=5, ctx=ctx).num_blocks == (
        2562
    )
    with pytest.raises(CapacityError, match="2562 block"):
        size_host_pool_for_specs(2561 * 81920, [source], alignment=5, ctx=ctx)
    with pytest.raises(PlanError, match="no host-resident group"):
        size_host_pool_for_specs(1 << 30, [indexer, hot])
