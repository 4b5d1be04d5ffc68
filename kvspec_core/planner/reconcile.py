"""Making workers agree: one plan from several (the smallest pools win).

Workers plan independently from their own free memory; they must end with the same groups
and specs (else they would lay the cache out differently) and the same block counts (the
scheduler hands the same block ids to all). Disagreeing specs are refused naming the first
differing layer or the first layer placed in another slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvspec_core.errors import PlanError
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.planner import rebuild_with_blocks
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
                "plan the same layer specs"
            )
    blocks = [min(plan.pools[i].num_blocks for plan in plans) for i in range(len(plans[0].pools))]
    return rebuild_with_blocks(
        plans[0],
        blocks,
        **_smallest_budgets(
            [plan.budget_bytes for plan in plans], [plan.host_budget_bytes for plan in plans]
        ),
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
                "must plan the same layer specs"
            )
    # Block counts, then the budgets (-1 stands for "no host budget").
    host = -1 if plan.host_budget_bytes is None else plan.host_budget_bytes
    # NCCL reduces only CUDA tensors; gloo and others take CPU tensors.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == dist.Backend.NCCL
        else torch.device("cpu")
    )
    counts = torch.tensor(
        [pool.num_blocks for pool in plan.pools] + [plan.budget_bytes, host],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    values = [int(count) for count in counts.tolist()]
    blocks, budget, host_budget = values[:-2], values[-2], values[-1]
    return rebuild_with_blocks(
        plan,
        blocks,
        budget_bytes=budget,
        host_budget_bytes=None if host_budget < 0 else host_budget,
    )
