"""The KV-cache planner: layer specs + byte budget -> groups, pools, tensors -> torch views.

::

    from kvspec_core.planner import plan_kv_cache, materialize
    plan = plan_kv_cache(layer_specs, 40 << 30, SizingContext(max_model_len=131072), manager)
    buffers = materialize(plan, device="cuda")
    buffers.views["model.layers.0.self_attn"]   # [blocks, heads, states, content] view
    plan_from_dict(plan.to_dict(), manager) == plan   # JSON round trip, edits refused

Design notes: ``kvspec_core/planner/README.md``.
"""

from kvspec_core.planner.layouts import LAYOUTS, KVCacheLayout, get_layout
from kvspec_core.planner.plan import KVCachePlan, KVCacheTensor, PlannedGroup, Pool
from kvspec_core.planner.plan_loading import plan_from_dict
from kvspec_core.planner.planner import largest_fitting_max_model_len, plan_kv_cache
from kvspec_core.planner.reconcile import agree_plan_across_ranks, reconcile_plans
from kvspec_core.planner.views import KVCacheBuffers, materialize

__all__ = [
    "LAYOUTS",
    "KVCacheBuffers",
    "KVCacheLayout",
    "KVCachePlan",
    "KVCacheTensor",
    "PlannedGroup",
    "Pool",
    "agree_plan_across_ranks",
    "get_layout",
    "largest_fitting_max_model_len",
    "materialize",
    "plan_from_dict",
    "plan_kv_cache",
    "reconcile_plans",
]
