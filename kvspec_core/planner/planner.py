"""``plan_kv_cache``: layer specs + byte budget -> groups, pools, tensors.

See ``kvspec_core/planner/README.md`` for the design and why it beats block inflation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvspec_core.byte_sizes import format_size
from kvspec_core.context import SizingContext
from kvspec_core.errors import CapacityError, InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner.budget import bytes_for_one_request, concurrency_of, split_budget
from kvspec_core.planner.geometry import (
    Segment,
    SegmentPlacement,
    cell_shape,
    lcm_alignment,
    place_segments,
    segments_of,
    tensor_strides,
    view_extent,
)
from kvspec_core.planner.grouping import GroupDraft, group_layers, pool_key, slot_runs
from kvspec_core.planner.layouts import DIM_B, DIM_L, KVCacheLayout, get_layout
from kvspec_core.planner.plan import KVCachePlan, KVCacheTensor, PlannedGroup, Pool
from kvspec_core.planner.plugin_faults import plugin_faults_named
from kvspec_core.planner.spec_answers import checked_blocks_per_request
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.uniform import UniformTypeSpecs
from kvspec_core.validation import MAX_FIELD_VALUE

#: Largest budget accepted (bytes): far above any machine, far below overflow of int64 views.
MAX_BUDGET_BYTES = 1 << 60


def _check_budget(value: object, owner: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(owner, name, value, "expected an int of bytes")
    if not 0 <= value <= MAX_BUDGET_BYTES:
        raise InvalidFieldError(
            owner, name, value, f"must be an int of bytes in [0, {MAX_BUDGET_BYTES}]"
        )
    return value


@attrs.frozen
class _Arguments:
    budget: int
    host_budget: int | None
    ctx: SizingContext
    layout: KVCacheLayout


def _check_arguments(
    owner: str, budget_bytes: object, host_budget_bytes: object, ctx: object,
    manager: object, layout: str,
) -> _Arguments:
    """The arguments every planner entry point shares, refused naming ``owner`` and field."""
    budget = _check_budget(budget_bytes, owner, "budget_bytes")
    host_budget = None if host_budget_bytes is None else _check_budget(
        host_budget_bytes, owner, "host_budget_bytes")
    if not isinstance(ctx, SizingContext):
        raise InvalidFieldTypeError(owner, "ctx", ctx, "expected a SizingContext")
    if not isinstance(manager, PluginManager):
        raise InvalidFieldTypeError(owner, "manager", manager,
                                    "expected a PluginManager (kvspec_core.load_plugins())")
    return _Arguments(budget, host_budget, ctx, get_layout(layout))


@attrs.frozen
class _PoolDraft:
    """A pool before its size is known."""

    group_ids: tuple[int, ...]
    host_resident: bool
    alignment: int
    segments: tuple[Segment, ...]
    block_bytes: int
    slot_bytes: tuple[int, ...]


@attrs.frozen
class _Skeleton:
    """Everything about a plan except block counts (they depend on the budget only)."""

    drafts: tuple[GroupDraft, ...]
    memoryless: tuple[str, ...]
    pools: tuple[_PoolDraft, ...]
    pool_of_group: tuple[int, ...]
    layout: KVCacheLayout


def group_kind(spec: KVSpec, manager: PluginManager) -> str:
    """The registry kind a group of ``spec`` reports (a uniform-type wrapper: its members')."""
    if isinstance(spec, UniformTypeSpecs):
        return manager.spec_kinds.kind_of(spec.first_spec)
    return manager.spec_kinds.kind_of(spec)


def _build_pools(drafts: Sequence[GroupDraft], layout: KVCacheLayout) -> tuple[
    tuple[_PoolDraft, ...], tuple[int, ...]
]:
    keys: dict[tuple[object, ...], list[int]] = {}
    for index, draft in enumerate(drafts):
        keys.setdefault(pool_key(draft, layout), []).append(index)
    pools = []
    pool_of_group = [0] * len(drafts)
    for pool_id, (key, members) in enumerate(keys.items()):
        segments = tuple(segments_of([slot_runs(drafts[i], layout) for i in members]))
        alignment = lcm_alignment(list({
            spec.block_stride_alignment
            for i in members
            for spec in (drafts[i].spec, *drafts[i].layer_specs)
        }))
        block_bytes, placements = place_segments(segments, layout, alignment, 1)
        slot_bytes = []
        for segment, placement in zip(segments, placements):
            if layout.layer_outer:
                per_slot = placement.strides[DIM_L]
            else:
                # Block-outer: a slot's share of the block is its segment's extent per layer.
                per_slot = place_segments((segment,), layout, 1, 1)[0] // segment.count
            slot_bytes.extend([per_slot] * segment.count)
        for i in members:
            pool_of_group[i] = pool_id
        pools.append(_PoolDraft(
            group_ids=tuple(members), host_resident=bool(key[-1]), alignment=alignment,
            segments=segments, block_bytes=block_bytes, slot_bytes=tuple(slot_bytes),
        ))
    return tuple(pools), tuple(pool_of_group)


def _skeleton(
    layer_specs: Mapping[str, KVSpec], ctx: SizingContext, manager: PluginManager,
    layout: KVCacheLayout,
) -> _Skeleton:
    drafts, memoryless = group_layers(layer_specs, manager, ctx, layout)
    pools, pool_of_group = _build_pools(drafts, layout)
    return _Skeleton(tuple(drafts), tuple(memoryless), pools, pool_of_group, layout)


def _demands(skeleton: _Skeleton, ctx: SizingContext) -> tuple[list[int], list[int]]:
    per_group = [
        checked_blocks_per_request(
            draft.spec, ctx, f"the group of layers {draft.layers[0]}..{draft.layers[-1]}")
        for draft in skeleton.drafts
    ]
    per_pool = [sum(per_group[i] for i in pool.group_ids) for pool in skeleton.pools]
    return per_group, per_pool


@attrs.frozen
class _Residency:
    """The pools of one residency (device or host), their demands and block bytes."""

    host: bool
    pool_ids: list[int]
    demands: list[int]
    block_bytes: list[int]


def _residencies(skeleton: _Skeleton, per_pool: Sequence[int]) -> list[_Residency]:
    """Device pools, then host pools; a residency without pools is left out."""
    result = []
    for host in (False, True):
        ids = [i for i, pool in enumerate(skeleton.pools) if pool.host_resident == host]
        if ids:
            result.append(_Residency(host, ids, [per_pool[i] for i in ids],
                                     [skeleton.pools[i].block_bytes for i in ids]))
    return result


def _fits(skeleton: _Skeleton, ctx: SizingContext, budget: int, host_budget: int | None) -> bool:
    _, per_pool = _demands(skeleton, ctx)
    for residency in _residencies(skeleton, per_pool):
        available = host_budget if residency.host else budget
        need = bytes_for_one_request(residency.demands, residency.block_bytes)
        if available is None or need > available:
            return False
    return True


def _largest_fitting(skeleton: _Skeleton, ctx: SizingContext, budget: int,
                     host_budget: int | None, upper: int) -> int:
    if not skeleton.pools or _fits(skeleton, attrs.evolve(ctx, max_model_len=upper),
                                   budget, host_budget):
        return upper
    low, high = 0, upper  # fits(low) (0 stands for "none"), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        if _fits(skeleton, attrs.evolve(ctx, max_model_len=middle), budget, host_budget):
            low = middle
        else:
            high = middle
    return low


def _capacity_error(skeleton: _Skeleton, ctx: SizingContext, host: bool, need: int,
                    available: int, budget: int, host_budget: int | None) -> CapacityError:
    largest = _largest_fitting(skeleton, ctx, budget, host_budget, ctx.max_model_len - 1) \
        if ctx.max_model_len > 1 else 0
    where = "host budget (host_budget_bytes)" if host else "KV-cache budget"
    fix = (f"the largest max_model_len that fits is {largest}; lower max_model_len to it or "
           "raise the budget") if largest else (
        "no max_model_len fits; raise the budget, use a smaller KV dtype or more parallelism")
    return CapacityError(
        f"one request of max_model_len={ctx.max_model_len} tokens needs {need} bytes "
        f"({format_size(need)}, one null block per pool included), but the {where} is {available} "
        f"bytes ({format_size(available)}); {fix}"
    )


def _assemble(
    skeleton: _Skeleton, kinds: Sequence[str],
    blocks: Sequence[int], ctx: SizingContext, budget: int, host_budget: int | None,
) -> KVCachePlan:
    layout = skeleton.layout
    per_group, per_pool = _demands(skeleton, ctx)
    groups = tuple(
        PlannedGroup(
            id=index, kind=kinds[index], layers=draft.layers, spec=draft.spec,
            pool=skeleton.pool_of_group[index], blocks_per_request=per_group[index],
        )
        for index, draft in enumerate(skeleton.drafts)
    )
    pools = tuple(
        Pool(
            id=index, num_blocks=blocks[index], block_bytes=draft.block_bytes,
            groups=draft.group_ids, host_resident=draft.host_resident,
            blocks_per_request=per_pool[index], slot_bytes=draft.slot_bytes,
            alignment=draft.alignment,
        )
        for index, draft in enumerate(skeleton.pools)
    )
    tensors = []
    for pool, draft in zip(pools, skeleton.pools):
        _, placements = place_segments(draft.segments, layout, draft.alignment, pool.num_blocks)
        slot_place: list[tuple[SegmentPlacement, int]] = []
        for segment, placement in zip(draft.segments, placements):
            slot_place.extend((placement, within) for within in range(segment.count))
        for group_id in draft.group_ids:
            tensors.extend(_group_tensors(groups[group_id], pool, slot_place, layout))
    device_bytes = sum(pool.size_bytes for pool in pools if not pool.host_resident)
    host_bytes = sum(pool.size_bytes for pool in pools if pool.host_resident)
    page_padding = alignment_padding = 0
    for pool in pools:
        if pool.host_resident:
            continue
        slot_total = sum(pool.slot_bytes)
        content = max(groups[g].real_page_size_bytes for g in pool.groups)
        page_padding += pool.num_blocks * (slot_total - content)
        alignment_padding += pool.num_blocks * (pool.block_bytes - slot_total)
    idle = budget - device_bytes
    demands = [pool.blocks_per_request for pool in pools]
    return KVCachePlan(
        groups=groups, pools=pools, tensors=tuple(tensors), layout=layout.name, context=ctx,
        budget_bytes=budget, host_budget_bytes=host_budget, bytes_allocated=device_bytes,
        host_bytes_allocated=host_bytes,
        bytes_padding=page_padding + alignment_padding + idle,
        padding_breakdown=(("page_padding", page_padding), ("alignment", alignment_padding),
                           ("idle_budget", idle)),
        max_concurrency=concurrency_of([p.num_blocks for p in pools], demands),
        memoryless_layers=skeleton.memoryless,
    )


def _group_tensors(
    group: PlannedGroup, pool: Pool, slot_place: Sequence[tuple[SegmentPlacement, int]],
    layout: KVCacheLayout,
) -> list[KVCacheTensor]:
    """One tensor per run of consecutive layers with one spec and one segment."""
    tensors: list[KVCacheTensor] = []
    specs = group.layer_specs
    start = 0
    while start < len(group.layers):
        end = start + 1
        while (end < len(group.layers)
               and (specs[end] is specs[start] or specs[end] == specs[start])
               and slot_place[end][0] is slot_place[start][0]):
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
        tensors.append(KVCacheTensor(
            size=pool.size_bytes, layers=group.layers[start:end], layer_stride=strides[DIM_L],
            block_stride=strides[DIM_B], offset=offset, host_resident=pool.host_resident,
            pool=pool.id, group=group.id, shape=shape, strides=strides, raw=cell.raw,
        ))
        start = end
    return tensors


def _host_check(skeleton: _Skeleton, host_budget: int | None) -> None:
    host_groups = [",".join(d.layers[:2]) for d, p in zip(skeleton.drafts, skeleton.pool_of_group)
                   if skeleton.pools[p].host_resident]
    if host_groups and host_budget is None:
        raise PlanError(
            f"groups of layers {'; '.join(host_groups)} are host-resident, so their pool lives "
            "in host memory: pass host_budget_bytes (the HiSparse plugin exports a function "
            "that sizes it)"
        )


def plan_kv_cache(
    layer_specs: Mapping[str, KVSpec],
    budget_bytes: int,
    ctx: SizingContext,
    manager: PluginManager,
    *,
    layout: str = "LBHNC",
    host_budget_bytes: int | None = None,
) -> KVCachePlan:
    """Plan the KV cache of ``layer_specs`` (model order) within ``budget_bytes``.

    Groups layers by the registry's merge rules, gives each page-size class its own pool
    (one null block each), and splits the budget so that the most max-length requests fit
    at once. Block sizes are never changed. Host-resident groups are sized from
    ``host_budget_bytes``. Raises :class:`CapacityError` when one request of
    ``ctx.max_model_len`` does not fit, naming needed and available bytes and the largest
    max model length that fits; :class:`PlanError` when the layout cannot hold the specs;
    :class:`PluginError` naming the plugin, spec kind and method when a spec method raises.
    """
    args = _check_arguments("plan_kv_cache", budget_bytes, host_budget_bytes, ctx, manager,
                            layout)
    with plugin_faults_named(manager, "planning the KV cache"):
        return _plan(layer_specs, args, manager)


def _plan(layer_specs: Mapping[str, KVSpec], args: _Arguments,
          manager: PluginManager) -> KVCachePlan:
    budget, host_budget, ctx = args.budget, args.host_budget, args.ctx
    skeleton = _skeleton(layer_specs, ctx, manager, args.layout)
    _host_check(skeleton, host_budget)
    _, per_pool = _demands(skeleton, ctx)
    blocks = [0] * len(skeleton.pools)
    for residency in _residencies(skeleton, per_pool):
        available = host_budget if residency.host else budget
        assert available is not None  # _host_check refused a missing host budget
        split = split_budget(residency.demands, residency.block_bytes, available)
        if split is None:
            need = bytes_for_one_request(residency.demands, residency.block_bytes)
            raise _capacity_error(skeleton, ctx, residency.host, need,
                                  available, budget, host_budget)
        for i, count in zip(residency.pool_ids, split):
            blocks[i] = count
    kinds = [group_kind(draft.spec, manager) for draft in skeleton.drafts]
    return _assemble(skeleton, kinds, blocks, ctx, budget, host_budget)


def largest_fitting_max_model_len(
    layer_specs: Mapping[str, KVSpec],
    budget_bytes: int,
    ctx: SizingContext,
    manager: PluginManager,
    *,
    layout: str = "LBHNC",
    host_budget_bytes: int | None = None,
    upper: int = MAX_FIELD_VALUE,
) -> int:
    """The largest ``max_model_len`` (at most ``upper``) for which one request fits the
    budget, by each family's own per-request formula; 0 if none does. Families whose demand
    stops growing (sliding window, Mamba) make every length fit: then ``upper`` is returned.
    """
    args = _check_arguments("largest_fitting_max_model_len", budget_bytes, host_budget_bytes,
                            ctx, manager, layout)
    if isinstance(upper, bool) or not isinstance(upper, int):
        raise InvalidFieldTypeError("largest_fitting_max_model_len", "upper", upper,
                                    "expected an int of tokens")
    if not 1 <= upper <= MAX_FIELD_VALUE:
        raise InvalidFieldError("largest_fitting_max_model_len", "upper", upper,
                                f"must be an int in [1, {MAX_FIELD_VALUE}]")
    with plugin_faults_named(manager, "finding the largest max_model_len that fits"):
        skeleton = _skeleton(layer_specs, args.ctx, manager, args.layout)
        return _largest_fitting(skeleton, args.ctx, args.budget, args.host_budget, upper)


def rebuild_with_blocks(plan: KVCachePlan, blocks: Sequence[int],
                        *, budget_bytes: int | None = None,
                        host_budget_bytes: int | None = None) -> KVCachePlan:
    """The same plan with other per-pool block counts (each at least one request's worth),
    optionally under another budget that still holds them."""
    skeleton = _skeleton_of_plan(plan)
    if len(blocks) != len(plan.pools):
        raise PlanError(f"the plan has {len(plan.pools)} pools but got {len(blocks)} block "
                        "counts; pass one count per pool")
    for pool, count in zip(plan.pools, blocks):
        if isinstance(count, bool) or not isinstance(count, int):
            raise PlanError(f"block count of pool {pool.id} is {count!r}; expected an int")
        if count < pool.blocks_per_request + 1:
            raise CapacityError(
                f"pool {pool.id} would get {count} blocks, fewer than one request's "
                f"{pool.blocks_per_request} plus the null block"
            )
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    host_budget = plan.host_budget_bytes if host_budget_bytes is None else host_budget_bytes
    for host, available in ((False, budget), (True, host_budget)):
        used = sum(count * pool.block_bytes for pool, count in zip(plan.pools, blocks)
                   if pool.host_resident == host)
        if used and (available is None or used > available):
            raise CapacityError(
                f"{'host' if host else 'device'} pools would take {used} bytes, more than "
                f"the budget of {available} bytes"
            )
    kinds = [group.kind for group in plan.groups]
    return _assemble(skeleton, kinds, blocks, plan.context, budget, host_budget)


def _skeleton_of_plan(plan: KVCachePlan) -> _Skeleton:
    layout = get_layout(plan.layout)
    drafts = [GroupDraft(group.layers, group.spec) for group in plan.groups]
    pools, pool_of_group = _build_pools(drafts, layout)
    if pool_of_group != tuple(group.pool for group in plan.groups):
        raise PlanError("the plan's pool assignment does not follow from its groups; it was "
                        "not written by this planner")
    return _Skeleton(tuple(drafts), plan.memoryless_layers, pools, pool_of_group, layout)
