"""Planning a whole model: config -> layer specs -> sizing context -> KV-cache plan.

Public API::

    result = plan_model(config, budget_bytes=40 << 30, options=PlanOptions(), manager=manager)
    result.plan.max_concurrency

When one request of the max model length does not fit, the planner's :class:`CapacityError`
says so and names the largest max model length that does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import CapacityError
from kvspec_core.models.ingest import (
    DEFAULT_MAX_IN_FLIGHT_TOKENS,
    ModelLayers,
    default_sizing_context,
    layer_specs,
    model_layers,
)
from kvspec_core.models.normalized import ModelConfig
from kvspec_core.models.trained_length import default_plan_length
from kvspec_core.plugins.layer_config import PlanOptions

if TYPE_CHECKING:
    from kvspec_core.planner.plan import KVCachePlan
    from kvspec_core.plugins.manager import PluginManager
    from kvspec_core.specs.base import KVSpec


@attrs.frozen(kw_only=True, eq=False)
class ModelPlan:
    """A model planned at one budget: its layers, specs, sizing context and plan."""

    model: ModelLayers
    specs: Mapping[str, KVSpec]
    context: SizingContext
    plan: KVCachePlan

    @property
    def kv_bytes_per_request(self) -> int:
        """Budget bytes one request of ``max_model_len`` tokens takes, summed over the device
        pools (its blocks times their physical size)."""
        return sum(pool.blocks_per_request * pool.block_bytes for pool in self.plan.device_pools)

    @property
    def kv_bytes_per_token(self) -> float:
        """:attr:`kv_bytes_per_request` over ``max_model_len``: the average cost of a token."""
        return self.kv_bytes_per_request / self.context.max_model_len


@attrs.frozen(kw_only=True, eq=False)
class PreparedModel:
    """A model's layers, specs and sizing context, ready to plan at any budget; the
    offload tier options (``plan_kv_cache``'s) go to every plan made from it."""

    model: ModelLayers
    specs: Mapping[str, KVSpec]
    context: SizingContext
    host_offload_bytes: int | None = None
    disk_offload_bytes: int | None = None
    disk_path: str | None = None

    def plan(self, budget_bytes: int, manager: PluginManager) -> ModelPlan:
        """The plan within ``budget_bytes`` (:class:`CapacityError` when one request of
        ``context.max_model_len`` does not fit; it names the largest length that does)."""
        from kvspec_core.planner import plan_kv_cache
        from kvspec_core.runtime.rules import rules_for

        plan = plan_kv_cache(
            self.specs,
            budget_bytes,
            self.context,
            manager,
            host_offload_bytes=self.host_offload_bytes,
            disk_offload_bytes=self.disk_offload_bytes,
            disk_path=self.disk_path,
        )
        # The plan counts what the allocator will admit: a group whose runtime rules keep
        # more than its spec is sized for (a plugin kind without rules of its own) is
        # refused here, as the allocator built from the plan would refuse it.
        for group in plan.groups:
            rules_for(group.spec, plan.context, manager)
        return ModelPlan(model=self.model, specs=self.specs, context=self.context, plan=plan)

    def largest_fitting_max_model_len(self, budget_bytes: int, manager: PluginManager) -> int:
        """The largest max model length one request of which fits ``budget_bytes`` (0: none)."""
        from kvspec_core.planner import largest_fitting_max_model_len

        return largest_fitting_max_model_len(self.specs, budget_bytes, self.context, manager)


def prepare_model(
    config: Mapping[str, Any] | ModelConfig,
    options: PlanOptions,
    manager: PluginManager,
    *,
    name: str = "model",
    max_model_len: int | None = None,
    max_in_flight_tokens: int = DEFAULT_MAX_IN_FLIGHT_TOKENS,
    host_offload_bytes: int | None = None,
    disk_offload_bytes: int | None = None,
    disk_path: str | None = None,
) -> PreparedModel:
    """Type ``config``'s layers, ask the plugins for their specs, and build the sizing
    context; the offload tier options are kept for its plans (see ``plan_kv_cache``)."""
    model = model_layers(config, options, manager, name=name)
    specs = layer_specs(model, manager)
    ctx = default_sizing_context(
        model,
        # vLLM's default length (RoPE factor included), not the config field alone.
        max_model_len=default_plan_length(model) if max_model_len is None else max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
    )
    return PreparedModel(
        model=model,
        specs=specs,
        context=ctx,
        host_offload_bytes=host_offload_bytes,
        disk_offload_bytes=disk_offload_bytes,
        disk_path=disk_path,
    )


def plan_model(
    config: Mapping[str, Any] | ModelConfig,
    budget_bytes: int,
    options: PlanOptions,
    manager: PluginManager,
    *,
    name: str = "model",
    max_model_len: int | None = None,
    max_in_flight_tokens: int = DEFAULT_MAX_IN_FLIGHT_TOKENS,
    host_offload_bytes: int | None = None,
    disk_offload_bytes: int | None = None,
    disk_path: str | None = None,
) -> ModelPlan:
    """Plan the KV cache of the model ``config`` describes within ``budget_bytes`` (and the
    offload tiers asked for, see ``plan_kv_cache``)."""
    prepared = prepare_model(
        config,
        options,
        manager,
        name=name,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        host_offload_bytes=host_offload_bytes,
        disk_offload_bytes=disk_offload_bytes,
        disk_path=disk_path,
    )
    return prepared.plan(budget_bytes, manager)


def context_lengths(max_model_len: int, block_size: int, points: int = 24) -> list[int]:
    """Context lengths to sample a concurrency curve at: geometric from one block (at least
    256 tokens) up to ``max_model_len``, which is always the last point."""
    low = min(max(256, block_size), max_model_len)
    if low == max_model_len or points < 2:
        return [max_model_len]
    ratio = (max_model_len / low) ** (1 / (points - 1))
    lengths = sorted({int(low * ratio**i) for i in range(points - 1)} | {max_model_len})
    return [length for length in lengths if length >= 1]


def concurrency_curve(
    config: Mapping[str, Any] | ModelConfig,
    budget_bytes: int,
    options: PlanOptions,
    manager: PluginManager,
    lengths: list[int],
    *,
    name: str = "model",
    max_in_flight_tokens: int = DEFAULT_MAX_IN_FLIGHT_TOKENS,
) -> list[tuple[int, float | None]]:
    """``(context length, max concurrency)`` for each length, each a full plan; ``None``
    where one request of that length does not fit the budget."""
    from kvspec_core.planner import plan_kv_cache

    model = model_layers(config, options, manager, name=name)
    specs = layer_specs(model, manager)
    curve: list[tuple[int, float | None]] = []
    for length in lengths:
        ctx = default_sizing_context(
            model, max_model_len=length, max_in_flight_tokens=max_in_flight_tokens
        )
        try:
            curve.append((length, plan_kv_cache(specs, budget_bytes, ctx, manager).max_concurrency))
        except CapacityError:
            curve.append((length, None))
    return curve
