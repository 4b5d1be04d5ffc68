"""The ``kvspec plan --json`` document: the plan, its pipeline stages and offload tiers as
plain data (the human report is rendered from it, :mod:`kvspec_core.cli.plan_text`)."""

from __future__ import annotations

from typing import Any

from kvspec_core.context import SizingContext
from kvspec_core.dtypes import dtype_name
from kvspec_core.models.pipeline import PipelinePlan
from kvspec_core.models.planning import ModelPlan
from kvspec_core.planner.plan import KVCachePlan, PlannedGroup
from kvspec_core.plugins.family_rules import block_tokens_of


def _block_positions(group: PlannedGroup, ctx: SizingContext) -> int | None:
    """Token positions one block of ``group`` spans (its block size times the DCP ranks
    that shard it); ``None`` for state families (Mamba), whose blocks hold a state, not
    tokens."""
    try:
        tokens_per_state = group.layer_specs[0].tokens_per_state
    except NotImplementedError:
        return None
    if tokens_per_state <= 0:
        return None
    return block_tokens_of(group.spec, ctx)


def _tokens_per_request(group: PlannedGroup, ctx: SizingContext) -> int | None:
    """Token positions one max-length request keeps in ``group`` (block granularity), or
    ``None`` (see :func:`_block_positions`)."""
    positions = _block_positions(group, ctx)
    return None if positions is None else group.blocks_per_request * positions


def _pool_tokens(plan: KVCachePlan, pool_id: int, blocks: int) -> int | None:
    """Tokens ``blocks`` blocks of pool ``pool_id`` hold, its null block left out; ``None``
    for a state pool (Mamba) or one whose groups' blocks hold different token counts."""
    sizes = {
        _block_positions(group, plan.context) for group in plan.groups if group.pool == pool_id
    }
    size = sizes.pop() if len(sizes) == 1 else None
    return None if size is None else (blocks - 1) * size


def tiers_report(plan: KVCachePlan) -> list[dict[str, Any]]:
    """The ``tiers`` of the ``--json`` document: each tier's budget, bytes used, the
    max-length requests it holds and, per pool, its blocks and tokens (``null`` for
    pools not offloaded and state pools)."""
    demands = [pool.blocks_per_request for pool in plan.pools]
    report = []
    for tier in plan.tiers:
        offloaded = [
            (count, demand)
            for count, demand in zip(tier.blocks_per_pool, demands, strict=True)
            if count
        ]
        report.append(
            {
                "name": tier.name,
                "path": tier.path,
                "budget_bytes": tier.budget_bytes,
                "bytes_allocated": tier.bytes_allocated,
                "num_blocks": sum(tier.blocks_per_pool),
                "max_concurrency": min((count - 1) / d for count, d in offloaded)
                if offloaded
                else 0.0,
                "pools": [
                    {
                        "pool": pool.id,
                        "num_blocks": count,
                        "tokens": _pool_tokens(plan, pool.id, count) if count else None,
                    }
                    for pool, count in zip(plan.pools, tier.blocks_per_pool, strict=True)
                ],
            }
        )
    return report


def plan_report(result: ModelPlan, *, source: str) -> dict[str, Any]:
    """The ``--json`` document (keys ``model``, ``kv_budget_bytes``, ``max_model_len``,
    ``num_blocks``, ``groups``, ``bytes_allocated``, ``bytes_padding``, ``max_concurrency``
    are a contract; the rest are extra facts)."""
    plan = result.plan
    options = result.model.options
    return {
        "model": result.model.name,
        "source": source,
        "kv_budget_bytes": plan.budget_bytes,
        "max_model_len": result.context.max_model_len,
        "max_in_flight_tokens": result.context.max_in_flight_tokens,
        "max_encoder_tokens": result.context.max_encoder_tokens,
        "mamba_cache_mode": result.context.mamba_cache_mode,
        "block_size": options.block_size,
        "kv_cache_dtype": options.kv_cache_dtype,
        "model_dtype": dtype_name(result.model.layers[0].model_dtype),
        "tensor_parallel_size": options.tensor_parallel_size,
        "decode_context_parallel_size": options.decode_context_parallel_size,
        "layout": plan.layout,
        "num_blocks": plan.num_blocks,
        "groups": [
            {
                "id": group.id,
                "kind": group.kind,
                "layers": list(group.layers),
                "block_size": group.block_size,
                "page_size_bytes": group.page_size_bytes,
                "blocks_per_request": group.blocks_per_request,
                "tokens_per_request": _tokens_per_request(group, plan.context),
                "pool": group.pool,
            }
            for group in plan.groups
        ],
        "pools": [
            {
                "id": pool.id,
                "num_blocks": pool.num_blocks,
                "block_bytes": pool.block_bytes,
                "groups": list(pool.groups),
                "blocks_per_request": pool.blocks_per_request,
                "host_resident": pool.host_resident,
                "max_concurrency": pool.max_concurrency,
            }
            for pool in plan.pools
        ],
        "memoryless_layers": list(plan.memoryless_layers),
        "kv_sharing": sharing_report(plan),
        "bytes_allocated": plan.bytes_allocated,
        "bytes_padding": plan.bytes_padding,
        "padding_breakdown": dict(plan.padding_breakdown),
        "kv_bytes_per_request": result.kv_bytes_per_request,
        "kv_bytes_per_token": result.kv_bytes_per_token,
        "max_concurrency": plan.max_concurrency,
        "tiers": tiers_report(plan),
    }


def sharing_report(plan: KVCachePlan) -> list[dict[str, str]]:
    """``kv_sharing``: each layer reading another's cache and that layer (``source``), the
    keys of the plan document's ``kv_sharing``."""
    return [{"layer": reader, "source": source} for reader, source in plan.kv_sharing]


def pipeline_report(pipeline: PipelinePlan, pp_size: int) -> dict[str, Any]:
    """The ``--json`` keys describing the pipeline stages (one stage without ``--pp``); a
    stage whose layers hold no cache is not listed. ``memoryless_layers`` and
    ``kv_sharing`` are every stage's (the top-level plan is the bottleneck stage's)."""
    plans = [stage.result.plan for stage in pipeline.stages]
    return {
        "pipeline_parallel_size": pp_size,
        "bottleneck_stage": pipeline.bottleneck.stage,
        "memoryless_layers": [layer for plan in plans for layer in plan.memoryless_layers],
        "kv_sharing": [entry for plan in plans for entry in sharing_report(plan)],
        "pipeline_stages": [
            {
                "stage": stage.stage,
                "layer_range": list(stage.layer_range),
                # Layers holding a cache: a reader of another's holds none.
                "cache_layers": sum(len(group.layers) for group in stage.result.plan.groups),
                "memoryless_layers": list(stage.result.plan.memoryless_layers),
                "kv_sharing": sharing_report(stage.result.plan),
                "num_blocks": stage.result.plan.num_blocks,
                "bytes_allocated": stage.result.plan.bytes_allocated,
                "bytes_padding": stage.result.plan.bytes_padding,
                "kv_bytes_per_request": stage.result.kv_bytes_per_request,
                "max_concurrency": stage.result.plan.max_concurrency,
            }
            for stage in pipeline.stages
        ],
    }
