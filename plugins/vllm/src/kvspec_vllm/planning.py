"""kvspec's plan as vLLM's ``KVCacheConfig``: the replacement of ``get_kv_cache_configs``.

vLLM's own function runs first: it merges the workers' layer specs, tags sliding windows
with the tokens speculative decoding retains, groups layers (or promotes them to full
attention when the hybrid manager is off), fits ``max_model_len`` when asked to and checks
that one request fits. Its per-layer specs are then planned by kvspec's planner
(:func:`kvspec_core.planner.plan_kv_cache`) on the memory vLLM measured, with vLLM's layout,
and the plan's groups, block count and tensor placement become the ``KVCacheConfig`` every
worker allocates and the scheduler manages. Layers that read another layer's cache
(``kv_sharing_target_layer_name``, Gemma-3n) have no vLLM spec; they are planned as
``KVSharingSpec`` readers, holding nothing. Where the plan has no vLLM representation
(several pools: Mamba hybrids; spec classes kvspec-vllm does not translate; a pipeline stage
whose own grouping differs from vLLM's projection of the whole model's groups), a warning
says why, once per reason, and vLLM's own configs are returned unchanged. Under pipeline
parallelism each stage is planned on its own layers and memory, every worker gets the least
block count, and the groups keep vLLM's structure (:mod:`kvspec_vllm.pipeline_planning`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import KVSpecError, MissingFamilyError
from kvspec_core.planner import KVCachePlan, plan_kv_cache
from kvspec_core.planner.plan_parts import PlannedGroup
from kvspec_core.planner.planner import rebuild_with_blocks
from kvspec_core.plugins.manager import load_plugins
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.encoder import CrossAttentionSpec
from kvspec_core.specs.kv_sharing import KVSharingSpec
from kvspec_vllm.errors import NotRepresentable
from kvspec_vllm.pipeline_planning import groups_in_vllm_order, stages_of
from kvspec_vllm.specs import kvspec_spec_of, vllm_group_spec, vllm_module

#: A child of vLLM's logger, so the plugin's lines appear with vLLM's.
logger = logging.getLogger("vllm.kvspec")

GetKVCacheConfigs = Callable[[Any, list[dict[str, Any]], list[int]], list[Any]]


@attrs.frozen
class Outcome:
    """What the last call did: ``plan`` is kvspec's plan when vLLM runs on it (the first
    pipeline stage's under pipeline parallelism; ``stage_plans`` holds every stage's), ``None``
    when vLLM kept its own config, then ``reason`` says why."""

    plan: KVCachePlan | None
    reason: str | None
    vllm_num_blocks: int
    stage_plans: tuple[KVCachePlan, ...] = ()


_last: list[Outcome] = []
_warned: set[str] = set()


def last_outcome() -> Outcome | None:
    """What the KV-cache planning of this process did last (``None`` before any)."""
    return _last[-1] if _last else None


def planned_by_kvspec(original: GetKVCacheConfigs) -> GetKVCacheConfigs:
    """``get_kv_cache_configs`` planned by kvspec, falling back to ``original``."""

    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]
    ) -> list[Any]:
        own = original(vllm_config, kv_cache_specs, available_memory)
        vllm_blocks = min(config.num_blocks for config in own) if own else 0
        try:
            plans, configs = kvspec_configs(vllm_config, kv_cache_specs, available_memory, own)
        except NotRepresentable as refusal:
            _record(Outcome(None, refusal.reason, vllm_blocks))
            if refusal.reason not in _warned:
                _warned.add(refusal.reason)
                logger.warning(
                    "kvspec-vllm: vLLM keeps its own KV-cache plan (%d blocks): %s",
                    vllm_blocks,
                    refusal.reason,
                )
            return own
        plan = plans[0]
        _record(Outcome(plan, None, vllm_blocks, tuple(plans)))
        logger.info(
            "kvspec-vllm: KV cache planned by kvspec: %d blocks in %d groups on %d pipeline "
            "stage(s) (vLLM's own plan: %d blocks), max concurrency %.2f at max_model_len %d",
            plan.num_blocks,
            len(plan.groups),
            len(plans),
            vllm_blocks,
            min(stage.max_concurrency for stage in plans),
            plan.context.max_model_len,
        )
        return configs

    get_kv_cache_configs.__wrapped__ = original  # type: ignore[attr-defined]
    get_kv_cache_configs.kvspec_vllm = True  # type: ignore[attr-defined]
    return get_kv_cache_configs


def _record(outcome: Outcome) -> None:
    _last[:] = [outcome]


def kvspec_configs(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    available_memory: list[int],
    own: Sequence[Any],
) -> tuple[list[KVCachePlan], list[Any]]:
    """kvspec's plan of each pipeline stage (one without pipeline parallelism) and the
    per-worker ``KVCacheConfig`` built from them; raises :class:`NotRepresentable` where
    vLLM cannot run those plans.

    A stage's workers (its tensor-parallel ranks) hold the same layers; each stage is planned
    on the least memory of its workers, and every worker gets the least block count of all
    stages, as vLLM's one scheduler needs (``get_kv_cache_configs`` does the same)."""
    if not own or not any(kv_cache_specs):
        raise NotRepresentable("the model has no KV cache (attention-free)")
    if vllm_config.speculative_config is not None:
        raise NotRepresentable("speculative decoding (draft and eagle groups) is not planned")
    if vllm_config.attention_config.hisparse_config is not None:
        raise NotRepresentable("HiSparse host pools are not planned")
    stages = stages_of(kv_cache_specs)
    if len(stages) > 1 and any(not kv_cache_specs[workers[0]] for workers in stages):
        raise NotRepresentable("a pipeline stage holds no KV-cache layer")
    override = vllm_config.cache_config.num_gpu_blocks_override
    if override is not None:
        # vLLM sizes the cache from the override, not the measured memory
        # (get_kv_cache_configs replaces available_memory with override * bytes_per_block,
        # kv_cache_utils.py): plan on what its own config allocates, so a measured memory
        # holding less than one request does not refuse a cache vLLM runs.
        available_memory = [
            sum(tensor.size for tensor in config.kv_cache_tensors) for config in own
        ]
    planned = [
        _stage_plan(
            vllm_config,
            kv_cache_specs[workers[0]],
            own[workers[0]],
            min(available_memory[worker] for worker in workers),
            pipeline=len(stages) > 1,
        )
        for workers in stages
    ]
    blocks = override if override is not None else min(plan.num_blocks for plan, _ in planned)
    configs: list[Any] = [None] * len(kv_cache_specs)
    plans: list[KVCachePlan] = []
    for index, (workers, (plan, vllm_specs)) in enumerate(zip(stages, planned, strict=True)):
        if plan.num_blocks != blocks:
            block_bytes = plan.pools[0].block_bytes
            plan = rebuild_with_blocks(
                plan, [blocks], budget_bytes=max(plan.budget_bytes, blocks * block_bytes)
            )
        groups: Sequence[Any] = plan.groups
        if len(stages) > 1:
            groups = groups_in_vllm_order(plan, own[workers[0]].kv_cache_groups, index)
        config = _vllm_config_of(plan, groups, vllm_specs, vllm_config)
        for worker in workers:
            configs[worker] = copy.deepcopy(config)
        plans.append(plan)
    return plans, configs


def _stage_plan(
    vllm_config: Any, worker_specs: dict[str, Any], worker_own: Any, memory: int, pipeline: bool
) -> tuple[KVCachePlan, dict[str, Any]]:
    """kvspec's plan of one worker's layers on ``memory`` and the vLLM spec planned for each
    layer (vLLM's grouped spec, see :func:`_spec_to_plan`)."""
    grouped = _per_layer_specs(worker_own)
    if set(grouped) != set(worker_specs):
        raise NotRepresentable("vLLM's groups and the workers' layers disagree")
    vllm_specs = {
        layer: _spec_to_plan(spec, grouped[layer]) for layer, spec in worker_specs.items()
    }
    specs: dict[str, KVSpec] = {
        layer: kvspec_spec_of(layer, vllm_spec) for layer, vllm_spec in vllm_specs.items()
    }
    readers = _kv_sharing_readers(vllm_config, specs, pipeline)
    specs.update(readers)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    plan = _plan(specs, memory, _sizing_context(vllm_config, specs), layout)
    if readers:
        _check_readers_hold_nothing(plan, readers)
    return plan, vllm_specs


def _kv_sharing_readers(
    vllm_config: Any, specs: dict[str, KVSpec], pipeline: bool
) -> dict[str, KVSpec]:
    """The layers that read another layer's KV cache (cross-layer sharing, e.g. Gemma-3n),
    as kvspec ``KVSharingSpec`` specs, so that kvspec's plan lists them (``plan.kv_sharing``,
    ``plan.memoryless_layers``). vLLM's model runner gives such a layer no spec and binds it
    to its source's cache after the plan (``kv_caches[reader] = kv_caches[source]``), so a
    reader reads through its source's spec. Read from the attention modules of this process
    (``static_forward_context``: filled where the workers run in the engine-core process);
    none there, none listed, and the plan is the same."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    readers: dict[str, KVSpec] = {}
    for name, module in context.items():
        source = getattr(module, "kv_sharing_target_layer_name", None)
        if not source:
            continue
        if pipeline:
            raise NotRepresentable(
                f"layer {name} reads the KV cache of {source} (kv_sharing_target_layer_name) "
                "under pipeline parallelism; kvspec-vllm plans cross-layer KV sharing only "
                "where every worker holds every layer"
            )
        if name in specs:
            raise NotRepresentable(
                f"layer {name} reads the KV cache of {source} (kv_sharing_target_layer_name) "
                "but has a KV-cache spec of its own"
            )
        if source not in specs:
            raise NotRepresentable(
                f"layer {name} reads the KV cache of {source} (kv_sharing_target_layer_name), "
                "which holds no KV cache here"
            )
        readers[name] = KVSharingSpec(target_layer=source, reader_spec=specs[source])
    return readers


def _check_readers_hold_nothing(plan: KVCachePlan, readers: dict[str, KVSpec]) -> None:
    """vLLM's worker adds the readers to their sources' groups itself: kvspec's groups and
    tensors must not hold them."""
    held = {layer for group in plan.groups for layer in group.layers}
    held.update(layer for tensor in plan.tensors for layer in tensor.layers)
    if held & set(readers) or set(plan.memoryless_layers) != set(readers):
        raise NotRepresentable(
            f"kvspec's plan holds cache for the layers that read another's "
            f"({sorted(held & set(readers))}) or lists other layers without one "
            f"({sorted(set(plan.memoryless_layers) ^ set(readers))})"
        )


def _per_layer_specs(config: Any) -> dict[str, Any]:
    """Each layer's spec in vLLM's config (a uniform-type group's member specs)."""
    interface = vllm_module("vllm.v1.kv_cache_interface")
    specs: dict[str, Any] = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for layer in group.layer_names:
            if isinstance(spec, interface.UniformTypeKVCacheSpecs):
                specs[layer] = spec.kv_cache_specs[layer]
            else:
                specs[layer] = spec
    return specs


def _spec_to_plan(declared: Any, grouped: Any) -> Any:
    """The spec kvspec plans for a layer: vLLM's grouped one (sliding windows tagged with
    the tokens speculative decoding retains; local layers promoted to full attention when
    the hybrid manager is off), unless grouping changed its page (a block size inflated or
    a page padded to another group's): kvspec plans the layer as the model declared it."""
    if grouped.block_size != declared.block_size or grouped.page_size_bytes != (
        declared.page_size_bytes
    ):
        return declared
    return grouped


def _sizing_context(vllm_config: Any, specs: dict[str, KVSpec]) -> SizingContext:
    cache = vllm_config.cache_config
    # vLLM sizes a cross-attention layer for the scheduler's encoder budget
    # (CrossAttentionSpec.max_memory_usage_bytes); kvspec reads it from the context.
    has_cross = any(isinstance(spec, CrossAttentionSpec) for spec in specs.values())
    encoder_tokens = vllm_config.scheduler_config.max_num_encoder_input_tokens if has_cross else 0
    return SizingContext(
        max_encoder_tokens=encoder_tokens,
        max_model_len=vllm_config.model_config.max_model_len,
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
        dcp_size=vllm_config.parallel_config.decode_context_parallel_size,
        mamba_cache_mode=str(cache.mamba_cache_mode),
        prefix_caching=bool(cache.enable_prefix_caching),
    )


def _plan(specs: dict[str, KVSpec], budget: int, ctx: SizingContext, layout: str) -> KVCachePlan:
    try:
        plan = plan_kv_cache(specs, budget, ctx, load_plugins(), layout=layout)
    except MissingFamilyError as error:
        # A family plugin filtered out by KVSPEC_PLUGINS (or failing to load): vLLM still
        # runs, on its own plan, rather than not at all.
        raise NotRepresentable(f"kvspec cannot plan this model's layers: {error}") from error
    except KVSpecError as error:
        if not any(isinstance(spec, KVSharingSpec) for spec in specs.values()):
            raise
        # A pairing kvspec's planner refuses (kv_sharing's checks): vLLM keeps its plan.
        raise NotRepresentable(
            f"kvspec cannot plan this model's cross-layer KV sharing: {error}"
        ) from error
    device_pools = plan.device_pools
    if len(device_pools) != 1 or len(plan.pools) != 1:
        raise NotRepresentable(
            f"kvspec plans {len(plan.pools)} block pools (page sizes "
            f"{sorted({pool.block_bytes for pool in plan.pools})} bytes per block); vLLM 0.32 "
            "has one block pool, so it cannot run a multi-pool plan without inflating block "
            "sizes, which kvspec does not do"
        )
    return plan


def _vllm_config_of(
    plan: KVCachePlan, groups: Sequence[Any], vllm_specs: dict[str, Any], vllm_config: Any
) -> Any:
    """vLLM's ``KVCacheConfig`` of ``plan`` with ``groups``: the plan's groups, in the order
    vLLM's scheduler numbers them, or vLLM's own empty ones (a pipeline stage holding no
    layer of that group)."""
    interface = vllm_module("vllm.v1.kv_cache_interface")
    utils = vllm_module("vllm.v1.core.kv_cache_utils")
    vllm_groups = [
        interface.KVCacheGroupSpec(
            list(group.layers), vllm_group_spec(group.spec, group.layers, vllm_specs)
        )
        if isinstance(group, PlannedGroup)
        else copy.deepcopy(group)
        for group in groups
    ]
    tensors = [
        interface.KVCacheTensor(
            size=tensor.size,
            layers=list(tensor.layers),
            layer_stride=tensor.layer_stride,
            block_stride=tensor.block_stride,
            offset=tensor.offset,
        )
        for tensor in plan.tensors
    ]
    config = interface.KVCacheConfig(
        num_blocks=plan.pools[0].num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=vllm_groups,
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
    )
    config.kv_tp_replicas = utils.kv_cache_groups_tp_replicas(
        vllm_groups,
        vllm_config.parallel_config.tensor_parallel_size,
        vllm_config.parallel_config.decode_context_parallel_size,
    )
    return config
