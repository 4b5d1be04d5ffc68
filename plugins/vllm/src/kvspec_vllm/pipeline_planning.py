"""Pipeline parallelism: kvspec's per-stage plans in vLLM's one group structure.

vLLM 0.32 (``get_kv_cache_configs``) merges the workers' specs, groups the whole model's
layers once and projects those groups onto each worker (a group keeps its place, holding
only that worker's layers, possibly none), so that group ``i`` means the same thing on every
stage: one scheduler manages one block table for all of them. Each worker's block count
comes from its own memory and layers; every worker then gets the least of them. kvspec
plans each stage's own layers on its own memory, as ``kvspec plan --pp`` does; a stage plan
is used only where its groups are exactly vLLM's projected ones (same layers, same order
inside a group), and it is then placed in vLLM's group order, vLLM's empty groups kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec_core.planner import KVCachePlan
from kvspec_core.planner.plan_parts import PlannedGroup
from kvspec_vllm.errors import NotRepresentable


def stages_of(kv_cache_specs: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The workers of each pipeline stage (workers holding the same layers: one stage's
    tensor-parallel ranks), stages in the order their first worker comes."""
    stages: dict[frozenset[str], list[int]] = {}
    for worker, specs in enumerate(kv_cache_specs):
        stages.setdefault(frozenset(specs), []).append(worker)
    layer_sets = list(stages)
    for index, layers in enumerate(layer_sets):
        for other in layer_sets[index + 1 :]:
            if layers & other:
                raise NotRepresentable(
                    f"workers {stages[layers]} and {stages[other]} hold different layer sets "
                    f"that overlap ({sorted(layers & other)[:3]}...); vLLM's pipeline stages "
                    "hold disjoint layers"
                )
    return list(stages.values())


def groups_in_vllm_order(
    plan: KVCachePlan, projected: Sequence[Any], stage: int
) -> list[PlannedGroup | Any]:
    """The stage plan's groups in vLLM's projected group order: each non-empty vLLM group
    replaced by the plan's group holding the same layers; vLLM's empty groups (no layer of
    that group on this stage) kept as they are. Raises :class:`NotRepresentable` where the
    stage plan groups its layers otherwise (a hybrid stage whose own layer ratio differs
    from the whole model's, which vLLM's grouping follows)."""
    by_layers = {tuple(group.layers): group for group in plan.groups}
    wanted = [tuple(group.layer_names) for group in projected if group.layer_names]
    if sorted(wanted) != sorted(by_layers):
        raise NotRepresentable(
            f"pipeline stage {stage}: kvspec groups its layers as "
            f"{[list(layers) for layers in by_layers]}, vLLM's groups of the whole model "
            f"project onto it as {[list(layers) for layers in wanted]}; one scheduler "
            "manages every stage in vLLM's group structure, so kvspec's stage plan cannot "
            "be used"
        )
    return [
        by_layers[tuple(group.layer_names)] if group.layer_names else group for group in projected
    ]
