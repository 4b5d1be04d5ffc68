"""The skeleton of a plan: its groups and pools with every size except the pools' block
counts, which depend on the budget alone, and the blocks one max-length request takes from
each group and pool. Built from layer specs when planning, or from a plan being rebuilt with
other block counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner.geometry import Segment, lcm_alignment, place_segments, segments_of
from kvspec_core.planner.grouping import GroupDraft, group_layers, pool_key, slot_runs
from kvspec_core.planner.kv_sharing import check_plan_sharing, resolve_kv_sharing
from kvspec_core.planner.layouts import DIM_L, KVCacheLayout, get_layout
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.spec_answers import checked_blocks_per_request, checked_fixed_blocks
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec


@attrs.frozen
class PoolDraft:
    """A pool before its size is known."""

    group_ids: tuple[int, ...]
    host_resident: bool
    alignment: int
    segments: tuple[Segment, ...]
    block_bytes: int
    slot_bytes: tuple[int, ...]


@attrs.frozen
class Skeleton:
    """Everything about a plan except block counts (they depend on the budget only)."""

    drafts: tuple[GroupDraft, ...]
    memoryless: tuple[str, ...]
    pools: tuple[PoolDraft, ...]
    pool_of_group: tuple[int, ...]
    layout: KVCacheLayout
    #: ``(reader, source)``: memoryless layers that read another layer's cache.
    kv_sharing: tuple[tuple[str, str], ...] = ()


def build_pools(
    drafts: Sequence[GroupDraft], layout: KVCacheLayout
) -> tuple[tuple[PoolDraft, ...], tuple[int, ...]]:
    """The pools of ``drafts`` (one per page-size class and residency) and each group's pool."""
    keys: dict[tuple[object, ...], list[int]] = {}
    for index, draft in enumerate(drafts):
        keys.setdefault(pool_key(draft, layout), []).append(index)
    pools = []
    pool_of_group = [0] * len(drafts)
    for pool_id, (key, members) in enumerate(keys.items()):
        segments = tuple(segments_of([slot_runs(drafts[i], layout) for i in members]))
        alignment = lcm_alignment(
            list(
                {
                    spec.block_stride_alignment
                    for i in members
                    for spec in (drafts[i].spec, *drafts[i].layer_specs)
                }
            )
        )
        block_bytes, placements = place_segments(segments, layout, alignment, 1)
        slot_bytes = []
        for segment, placement in zip(segments, placements, strict=True):
            if layout.layer_outer:
                per_slot = placement.strides[DIM_L]
            else:
                # Block-outer: a slot's share of the block is its segment's extent per layer.
                per_slot = place_segments((segment,), layout, 1, 1)[0] // segment.count
            slot_bytes.extend([per_slot] * segment.count)
        for i in members:
            pool_of_group[i] = pool_id
        pools.append(
            PoolDraft(
                group_ids=tuple(members),
                host_resident=bool(key[-1]),
                alignment=alignment,
                segments=segments,
                block_bytes=block_bytes,
                slot_bytes=tuple(slot_bytes),
            )
        )
    return tuple(pools), tuple(pool_of_group)


def skeleton_of_specs(
    layer_specs: Mapping[str, KVSpec],
    ctx: SizingContext,
    manager: PluginManager,
    layout: KVCacheLayout,
) -> Skeleton:
    """The groups and pools of ``layer_specs``."""
    drafts, memoryless = group_layers(layer_specs, manager, ctx, layout)
    kv_sharing = resolve_kv_sharing(layer_specs, memoryless, manager)
    pools, pool_of_group = build_pools(drafts, layout)
    return Skeleton(
        tuple(drafts), tuple(memoryless), pools, pool_of_group, layout, kv_sharing=kv_sharing
    )


def blocks_per_request(skeleton: Skeleton, ctx: SizingContext) -> tuple[list[int], list[int]]:
    """Blocks one request of ``ctx.max_model_len`` takes from each group, and from each pool."""
    per_group = [
        checked_blocks_per_request(
            draft.spec, ctx, f"the group of layers {draft.layers[0]}..{draft.layers[-1]}"
        )
        for draft in skeleton.drafts
    ]
    per_pool = [sum(per_group[i] for i in pool.group_ids) for pool in skeleton.pools]
    return per_group, per_pool


def fixed_blocks_per_pool(skeleton: Skeleton, ctx: SizingContext) -> list[int]:
    """Of each pool's blocks per request, those a request holds whatever its length
    (``fixed_blocks_per_request`` of its groups' specs)."""
    per_group = [
        checked_fixed_blocks(
            draft.spec, ctx, f"the group of layers {draft.layers[0]}..{draft.layers[-1]}"
        )
        for draft in skeleton.drafts
    ]
    return [sum(per_group[i] for i in pool.group_ids) for pool in skeleton.pools]


def skeleton_of_plan(plan: KVCachePlan) -> Skeleton:
    """The skeleton ``plan`` was assembled from; refused if its groups would not give its
    pools."""
    layout = get_layout(plan.layout)
    drafts = [GroupDraft(group.layers, group.spec) for group in plan.groups]
    pools, pool_of_group = build_pools(drafts, layout)
    if pool_of_group != tuple(group.pool for group in plan.groups):
        raise PlanError(
            "the plan's pool assignment does not follow from its groups; it was "
            "not written by this planner"
        )
    check_plan_sharing(
        plan.kv_sharing,
        plan.memoryless_layers,
        {layer for group in plan.groups for layer in group.layers},
    )
    return Skeleton(
        tuple(drafts),
        plan.memoryless_layers,
        pools,
        pool_of_group,
        layout,
        kv_sharing=plan.kv_sharing,
    )
