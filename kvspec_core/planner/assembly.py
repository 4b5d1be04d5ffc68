"""Assembling a plan from its skeleton and block counts: the groups, the pools, one tensor
per run of same-spec layers placed in its pool's buffer, and the plan's byte figures
(allocated, padding by cause, concurrency)."""

from __future__ import annotations

from collections.abc import Sequence

from kvspec_core.context import SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner.budget import concurrency_of
from kvspec_core.planner.geometry import (
    SegmentPlacement,
    cell_shape,
    place_segments,
    tensor_strides,
    view_extent,
)
from kvspec_core.planner.layouts import DIM_B, DIM_L, KVCacheLayout
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.plan_parts import KVCacheTensor, PlannedGroup, Pool
from kvspec_core.planner.skeleton import Skeleton, blocks_per_request, fixed_blocks_per_pool
from kvspec_core.planner.tiers import TierRequest, size_tiers


def assemble(
    skeleton: Skeleton,
    kinds: Sequence[str],
    blocks: Sequence[int],
    ctx: SizingContext,
    budget: int,
    host_budget: int | None,
    tiers: TierRequest | None = None,
) -> KVCachePlan:
    """The plan of ``skeleton`` with ``blocks`` per pool; ``kinds`` names each group's kind;
    the offload ``tiers`` are sized over its pools."""
    layout = skeleton.layout
    per_group, per_pool = blocks_per_request(skeleton, ctx)
    fixed = fixed_blocks_per_pool(skeleton, ctx)
    if tiers is not None and (tiers.host_bytes is not None or tiers.disk_bytes is not None):
        _check_prefixes_cached(skeleton, ctx, per_group)
    groups = tuple(
        PlannedGroup(
            id=index,
            kind=kinds[index],
            layers=draft.layers,
            spec=draft.spec,
            pool=skeleton.pool_of_group[index],
            blocks_per_request=per_group[index],
        )
        for index, draft in enumerate(skeleton.drafts)
    )
    pools = tuple(
        Pool(
            id=index,
            num_blocks=blocks[index],
            block_bytes=draft.block_bytes,
            groups=draft.group_ids,
            host_resident=draft.host_resident,
            blocks_per_request=per_pool[index],
            fixed_blocks_per_request=fixed[index],
            slot_bytes=draft.slot_bytes,
            alignment=draft.alignment,
        )
        for index, draft in enumerate(skeleton.pools)
    )
    tensors = []
    for pool, draft in zip(pools, skeleton.pools, strict=True):
        _, placements = place_segments(draft.segments, layout, draft.alignment, pool.num_blocks)
        slot_place: list[tuple[SegmentPlacement, int]] = []
        for segment, placement in zip(draft.segments, placements, strict=True):
            slot_place.extend((placement, within) for within in range(segment.count))
        for group_id in draft.group_ids:
            tensors.extend(_group_tensors(groups[group_id], pool, slot_place, layout))
    device_bytes = sum(pool.size_bytes for pool in pools if not pool.host_resident)
    host_bytes = sum(pool.size_bytes for pool in pools if pool.host_resident)
    page_padding = alignment_padding = 0
    for pool, draft in zip(pools, skeleton.pools, strict=True):
        if pool.host_resident:
            continue
        # A block's bytes without block_stride_alignment: the rest is alignment padding
        # (in layer-outer layouts the aligned stride is inside each slot's bytes).
        unaligned, _ = place_segments(draft.segments, layout, 1, 1)
        content = max(groups[g].real_page_size_bytes for g in pool.groups)
        page_padding += pool.num_blocks * (unaligned - content)
        alignment_padding += pool.num_blocks * (pool.block_bytes - unaligned)
    idle = budget - device_bytes
    demands = [pool.blocks_per_request for pool in pools]
    return KVCachePlan(
        groups=groups,
        pools=pools,
        tensors=tuple(tensors),
        layout=layout.name,
        context=ctx,
        budget_bytes=budget,
        host_budget_bytes=host_budget,
        bytes_allocated=device_bytes,
        host_bytes_allocated=host_bytes,
        bytes_padding=page_padding + alignment_padding + idle,
        padding_breakdown=(
            ("page_padding", page_padding),
            ("alignment", alignment_padding),
            ("idle_budget", idle),
        ),
        max_concurrency=concurrency_of([p.num_blocks for p in pools], demands, fixed),
        memoryless_layers=skeleton.memoryless,
        kv_sharing=skeleton.kv_sharing,
        tiers=size_tiers(pools, tiers or TierRequest()),
    )


def _check_prefixes_cached(
    skeleton: Skeleton, ctx: SizingContext, per_group: Sequence[int]
) -> None:
    """Refuse offload tiers where no prefix is ever cached (prefix caching off, or a group
    holding blocks that caches none): they would stay empty."""
    why = None
    if not ctx.prefix_caching:
        why = "the context turns prefix caching off"
    else:
        for draft, demand in zip(skeleton.drafts, per_group, strict=True):
            if demand and not draft.spec.prefix_cacheable:
                why = (
                    f"the group of layers {draft.layers[0]}..{draft.layers[-1]} "
                    f"({draft.spec.kind}) caches no prefix, so no prefix of this model is "
                    "ever a hit"
                )
                break
    if why is not None:
        raise PlanError(
            f"offload tiers keep the prefix-cache blocks the device evicts, but {why}: the "
            "tiers would stay empty; leave host_offload_bytes / disk_offload_bytes out "
            "(--host-memory, --disk)"
        )


def _group_tensors(
    group: PlannedGroup,
    pool: Pool,
    slot_place: Sequence[tuple[SegmentPlacement, int]],
    layout: KVCacheLayout,
) -> list[KVCacheTensor]:
    """One tensor per run of consecutive layers with one spec and one segment."""
    tensors: list[KVCacheTensor] = []
    specs = group.layer_specs
    start = 0
    while start < len(group.layers):
        end = start + 1
        while (
            end < len(group.layers)
            and (specs[end] is specs[start] or specs[end] == specs[start])
            and slot_place[end][0] is slot_place[start][0]
        ):
            end += 1
        placement, within = slot_place[start]
        cell = cell_shape(specs[start], group.layers[start])
        count = end - start
        strides = tensor_strides(cell, count, pool.num_blocks, layout, placement)
        shape = (count, pool.num_blocks, cell.heads, cell.states, cell.content)
        offset = placement.offset + within * placement.strides[DIM_L]
        if view_extent(shape, strides, offset) > pool.size_bytes:
            raise PlanError(
                f"layers {group.layers[start]}..{group.layers[end - 1]} would reach byte "
                f"{view_extent(shape, strides, offset)} of pool {pool.id}'s "
                f"{pool.size_bytes}-byte buffer under layout {layout.name}; this is a planner "
                "bug, please report it with the layer specs"
            )
        tensors.append(
            KVCacheTensor(
                size=pool.size_bytes,
                layers=group.layers[start:end],
                layer_stride=strides[DIM_L],
                block_stride=strides[DIM_B],
                offset=offset,
                host_resident=pool.host_resident,
                pool=pool.id,
                group=group.id,
                shape=shape,
                strides=strides,
                raw=cell.raw,
            )
        )
        start = end
    return tensors
