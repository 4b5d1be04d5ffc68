"""``plan_kv_cache``: layer specs + byte budget -> groups, pools, tensors.

The entry points, each a few steps: arguments checked (:mod:`~kvspec_core.planner.arguments`),
groups and pools laid out (:mod:`~kvspec_core.planner.skeleton`), block counts sized from the
budget (:mod:`~kvspec_core.planner.capacity`), the plan assembled
(:mod:`~kvspec_core.planner.assembly`). See ``kvspec_core/planner/README.md`` for the design
and why it beats block inflation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_core.context import SizingContext
from kvspec_core.planner.arguments import (
    PlannerArguments,
    check_arguments,
    check_block_counts,
    check_upper,
)
from kvspec_core.planner.assembly import assemble
from kvspec_core.planner.capacity import blocks_per_pool, largest_fitting
from kvspec_core.planner.grouping import group_kind
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.plugin_faults import plugin_faults_named
from kvspec_core.planner.skeleton import skeleton_of_plan, skeleton_of_specs
from kvspec_core.planner.tiers import TierRequest, check_tier_request, request_of
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import MAX_FIELD_VALUE


def plan_kv_cache(
    layer_specs: Mapping[str, KVSpec],
    budget_bytes: int,
    ctx: SizingContext,
    manager: PluginManager,
    *,
    layout: str = "LBHNC",
    host_budget_bytes: int | None = None,
    host_offload_bytes: int | None = None,
    disk_offload_bytes: int | None = None,
    disk_path: str | None = None,
) -> KVCachePlan:
    """Plan the KV cache of ``layer_specs`` (model order) within ``budget_bytes``.

    Groups layers by the registry's merge rules, gives each page-size class its own pool
    (one null block each), and splits the budget so that the most max-length requests fit
    at once. Block sizes are never changed. Host-resident groups are sized from
    ``host_budget_bytes``. Raises :class:`CapacityError` when one request of
    ``ctx.max_model_len`` does not fit, naming needed and available bytes and the largest
    max model length that fits; :class:`PlanError` when the layout cannot hold the specs;
    :class:`PluginError` naming the plugin, spec kind and method when a spec method raises.

    Offload tiers: ``host_offload_bytes`` sizes a host-memory tier and
    ``disk_offload_bytes`` a disk tier whose files live in the existing, writable
    directory ``disk_path``; each is split between the device pools as the device budget
    is (``plan.tiers``). The host tier is separate from ``host_budget_bytes`` (host-resident
    pools are not offloaded). A tier that cannot hold one block beside the null block of
    every device pool raises :class:`~kvspec_core.planner.tiers.OffloadTierError`.
    """
    args = check_arguments("plan_kv_cache", budget_bytes, host_budget_bytes, ctx, manager, layout)
    tiers = check_tier_request("plan_kv_cache", host_offload_bytes, disk_offload_bytes, disk_path)
    with plugin_faults_named(manager, "planning the KV cache"):
        return _plan(layer_specs, args, tiers, manager)


def _plan(
    layer_specs: Mapping[str, KVSpec],
    args: PlannerArguments,
    tiers: TierRequest,
    manager: PluginManager,
) -> KVCachePlan:
    budget, host_budget, ctx = args.budget, args.host_budget, args.ctx
    skeleton = skeleton_of_specs(layer_specs, ctx, manager, args.layout)
    blocks = blocks_per_pool(skeleton, ctx, budget, host_budget)
    kinds = [group_kind(draft.spec, manager) for draft in skeleton.drafts]
    return assemble(skeleton, kinds, blocks, ctx, budget, host_budget, tiers)


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
    args = check_arguments(
        "largest_fitting_max_model_len", budget_bytes, host_budget_bytes, ctx, manager, layout
    )
    check_upper(upper)
    with plugin_faults_named(manager, "finding the largest max_model_len that fits"):
        skeleton = skeleton_of_specs(layer_specs, args.ctx, manager, args.layout)
        return largest_fitting(skeleton, args.ctx, args.budget, args.host_budget, upper)


def rebuild_with_blocks(
    plan: KVCachePlan,
    blocks: Sequence[int],
    *,
    budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    tiers: TierRequest | None = None,
) -> KVCachePlan:
    """The same plan with other per-pool block counts (each at least one request's worth),
    optionally under another budget that still holds them; its offload tiers are sized
    again from their budgets (``tiers``: other budgets for them)."""
    skeleton = skeleton_of_plan(plan)
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    host_budget = plan.host_budget_bytes if host_budget_bytes is None else host_budget_bytes
    check_block_counts(plan, blocks, budget, host_budget)
    kinds = [group.kind for group in plan.groups]
    return assemble(
        skeleton,
        kinds,
        blocks,
        plan.context,
        budget,
        host_budget,
        request_of(plan.tiers) if tiers is None else tiers,
    )
