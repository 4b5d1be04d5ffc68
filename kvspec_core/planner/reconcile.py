"""Making workers agree: one plan from several (the smallest pools win).

Workers plan independently from their own free memory; they must end with the same groups
and specs (else they would lay the cache out differently), the same block counts (the
scheduler hands the same block ids to all) and the same offload tiers, each sized from the
smallest budget asked for it (a disk tier keeps each worker's own folder). Disagreeing specs
are refused naming the first differing layer or the first layer placed in another slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvspec_core.errors import PlanError
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.planner import rebuild_with_blocks
from kvspec_core.planner.tiers import TierRequest
from kvspec_core.specs.serialization import spec_to_dict


def plan_signature(plan: KVCachePlan) -> dict[str, Any]:
    """What every worker must agree on, as plain data (no block counts)."""
    return {
        "layout": plan.layout,
        "context": attrs.asdict(plan.context),
        # A layer's slot fixes which bytes of a block it uses and which layers it aliases.
        "layers": [
            [layer, group.id, slot, spec_to_dict(spec)]
            for group in plan.groups
            for slot, (layer, spec) in enumerate(zip(group.layers, group.layer_specs, strict=True))
        ],
        "memoryless_layers": list(plan.memoryless_layers),
        "kv_sharing": [list(pair) for pair in plan.kv_sharing],
        "block_bytes": [pool.block_bytes for pool in plan.pools],
        # The tiers every worker has (their sizes are agreed: the smallest budget of each).
        "tiers": [tier.name for tier in plan.tiers],
    }


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Words naming the first thing two signatures disagree on, or ``None``."""
    for key in ("layout", "context"):
        if a[key] != b[key]:
            return f"{key} differs ({a[key]!r} vs {b[key]!r})"
    rows_a = {row[0]: row for row in a["layers"]}
    rows_b = {row[0]: row for row in b["layers"]}
    for layer, row in rows_a.items():
        other = rows_b.get(layer)
        if other is None:
            return f"layer {layer} is planned in one and not in the other"
        if row[3] != other[3]:
            return f"layer {layer} has spec {row[3]} vs {other[3]}"
        if row[1:3] != other[1:3]:
            return (
                f"layer {layer} is at slot {row[2]} of group {row[1]} vs slot {other[2]} "
                f"of group {other[1]}"
            )
    for layer in rows_b:
        if layer not in rows_a:
            return f"layer {layer} is planned in one and not in the other"
    if a["memoryless_layers"] != b["memoryless_layers"]:
        return (
            f"layers without memory differ ({a['memoryless_layers']} vs {b['memoryless_layers']})"
        )
    if a["kv_sharing"] != b["kv_sharing"]:
        return (
            f"layers reading another layer's cache differ ({a['kv_sharing']} vs {b['kv_sharing']})"
        )
    if a["block_bytes"] != b["block_bytes"]:
        return f"pool block bytes differ ({a['block_bytes']} vs {b['block_bytes']})"
    if a["tiers"] != b["tiers"]:
        return (
            f"offload tiers differ ({a['tiers'] or 'none'} vs {b['tiers'] or 'none'}): the "
            "scheduler hands out tier block ids every worker must hold; plan the same tiers"
        )
    return None


def reconcile_plans(plans: Sequence[KVCachePlan]) -> KVCachePlan:
    """One plan for all workers: equal groups and specs required, minimum blocks per pool."""
    plans = list(plans)
    if not plans:
        raise PlanError("reconcile_plans needs at least one plan")
    for index, plan in enumerate(plans):
        if not isinstance(plan, KVCachePlan):
            raise PlanError(
                f"reconcile_plans: plans[{index}] is a {type(plan).__name__}, not a "
                "KVCachePlan (plan_from_dict reads a dict)"
            )
    reference = plan_signature(plans[0])
    for index, plan in enumerate(plans[1:], start=1):
        difference = first_difference(reference, plan_signature(plan))
        if difference is not None:
            raise PlanError(
                f"plans 0 and {index} cannot be reconciled: {difference}; every worker must "
                "plan the same layer specs and offload tiers"
            )
    blocks = [min(plan.pools[i].num_blocks for plan in plans) for i in range(len(plans[0].pools))]
    tier_budgets = [
        min(plan.tiers[index].budget_bytes for plan in plans)
        for index in range(len(plans[0].tiers))
    ]
    return rebuild_with_blocks(
        plans[0],
        blocks,
        tiers=_tier_request(plans[0], tier_budgets),
        **_smallest_budgets(
            [plan.budget_bytes for plan in plans], [plan.host_budget_bytes for plan in plans]
        ),
    )


def _tier_request(plan: KVCachePlan, budgets: Sequence[int]) -> TierRequest:
    """``plan``'s tiers under the agreed ``budgets`` (one per tier, in order): every worker
    sizes them alike (same pools, same budget); a disk tier keeps this worker's own path."""
    by_name = {tier.name: budget for tier, budget in zip(plan.tiers, budgets, strict=True)}
    disk = next((tier for tier in plan.tiers if tier.name == "disk"), None)
    return TierRequest(
        by_name.get("host"), by_name.get("disk"), None if disk is None else disk.path
    )


def _smallest_budgets(
    budgets: Sequence[int], host_budgets: Sequence[int | None]
) -> dict[str, int | None]:
    """The agreed plan states the smallest budget: every worker's pools fit in it."""
    hosts = [value for value in host_budgets if value is not None]
    return {"budget_bytes": min(budgets), "host_budget_bytes": min(hosts) if hosts else None}


def agree_plan_across_ranks(plan: KVCachePlan, group: Any = None) -> KVCachePlan:
    """Collective over ``torch.distributed`` ``group``: every rank gets the same plan, with
    the minimum block count per pool over ranks. Ranks whose specs differ are refused on
    every rank alike, naming the first differing layer and the ranks."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, plan_signature(plan), group=group)
    for rank in range(1, world):
        difference = first_difference(gathered[0], gathered[rank])
        if difference is not None:
            raise PlanError(
                f"ranks 0 and {rank} planned different KV caches: {difference}; every rank "
                "must plan the same layer specs and offload tiers"
            )
    # Block counts, then the budgets (-1 stands for "no host budget").
    host = -1 if plan.host_budget_bytes is None else plan.host_budget_bytes
    # NCCL reduces only CUDA tensors; gloo and others take CPU tensors.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == dist.Backend.NCCL
        else torch.device("cpu")
    )
    num_pools = len(plan.pools)
    counts = torch.tensor(
        [pool.num_blocks for pool in plan.pools]
        + [plan.budget_bytes, host]
        + [tier.budget_bytes for tier in plan.tiers],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    values = [int(count) for count in counts.tolist()]
    blocks, budget, host_budget = values[:num_pools], values[num_pools], values[num_pools + 1]
    return rebuild_with_blocks(
        plan,
        blocks,
        budget_bytes=budget,
        host_budget_bytes=None if host_budget < 0 else host_budget,
        tiers=_tier_request(plan, values[num_pools + 2 :]),
    )
