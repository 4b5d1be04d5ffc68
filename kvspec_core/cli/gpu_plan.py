"""``kvspec plan MODEL --gpu NAME``: the KV budget is what one GPU has left after the weights
it holds and vLLM's overheads (:mod:`kvspec_core.deployment`), then the usual plan.

Each stage is planned within its GPU's budget here, and when the weights or one request do
not fit, the smallest TP at which they would is named; ``--plot`` draws one curve per TP.
The options are read in :mod:`kvspec_core.cli.gpu_options`, the weights counted in
:mod:`kvspec_core.cli.gpu_weights`, the extra ``--json`` keys built (and listed) in
:mod:`kvspec_core.cli.gpu_report` and the human breakdown rendered in
:mod:`kvspec_core.cli.gpu_text`.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvspec_core.cli.arguments import kv_cache_dtypes, plan_options
from kvspec_core.cli.gpu_options import (
    budget_options,
    check_budget_options,
    gpu_memory,
    gpu_requested,
)
from kvspec_core.cli.gpu_report import gpu_report
from kvspec_core.cli.gpu_text import gpu_lines
from kvspec_core.cli.gpu_weights import as_vllm_loads, model_weights_source, vllm_downcast
from kvspec_core.deployment.gpu_budget import (
    GpuBudget,
    WeightsSource,
    gpu_budget,
    tp_candidates,
    weights_do_not_fit,
)
from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.catalog import ResolvedModel
from kvspec_core.models.normalized import ModelConfig
from kvspec_core.models.pipeline import PipelinePlan, PreparedStage, StagePlan, split_stages
from kvspec_core.models.planning import prepare_model
from kvspec_core.plugins.manager import PluginManager

# The public names this module had before the options, weights, report and text split stay
# importable from here.
__all__ = [
    "MAX_PLOTTED_TP",
    "as_vllm_loads",
    "check_budget_options",
    "gpu_lines",
    "gpu_plot_curves",
    "gpu_requested",
    "model_weights_source",
    "plan_on_gpu",
]

#: Largest TP ``--plot`` draws with ``--gpu``: one node of eight GPUs.
MAX_PLOTTED_TP = 8


def _plan_stages(
    stages: list[PreparedStage], budget: GpuBudget, manager: PluginManager
) -> PipelinePlan:
    plans = []
    for stage in stages:
        kv_budget = budget.kv_budget_bytes[stage.stage]
        try:
            result = stage.prepared.plan(kv_budget, manager)
        except CapacityError as error:
            largest = stage.prepared.largest_fitting_max_model_len(kv_budget, manager)
            where = f"pipeline stage {stage.stage}: " if len(budget.kv_budget_bytes) > 1 else ""
            hint = f" (pass --max-model-len {largest})" if largest else ""
            raise CapacityError(f"{where}{error}{hint}") from None
        plans.append(StagePlan(stage=stage.stage, layer_range=stage.layer_range, result=result))
    return PipelinePlan(stages=tuple(plans))


def _plans_at(
    args: argparse.Namespace,
    resolved: ResolvedModel,
    config: ModelConfig,
    manager: PluginManager,
    budget: GpuBudget,
) -> bool:
    """Whether the weights fit ``budget`` and every stage holds one max-length request."""
    if not budget.fits:
        return False
    try:
        prepared = prepare_model(
            config,
            plan_options(
                argparse.Namespace(**{**vars(args), "tp": budget.tp}), kv_cache_dtypes(args)[0]
            ),
            manager,
            name=resolved.name,
            max_model_len=args.max_model_len,
            max_in_flight_tokens=args.max_in_flight_tokens,
        )
        _plan_stages(split_stages(prepared, args.pp, args.pp_partition), budget, manager)
    except (CapacityError, ConfigError):
        return False
    return True


def _smallest_tp_for_a_request(
    args: argparse.Namespace,
    resolved: ResolvedModel,
    config: ModelConfig,
    source: WeightsSource,
    options: dict[str, Any],
    manager: PluginManager,
) -> int | None:
    """The smallest TP (above ``--tp``) at which one max-length request fits, else ``None``
    (also when the weights cannot be split: ``source.unsplittable`` says why)."""
    for tp in tp_candidates(resolved.config):
        if tp <= args.tp:
            continue
        try:
            budget = gpu_budget(source, resolved.config, tp=tp, **options)
        except ConfigError:
            return None  # no larger TP can be judged; the caller's own error stands
        if _plans_at(args, resolved, config, manager, budget):
            return tp
    return None


def plan_on_gpu(
    args: argparse.Namespace,
    resolved: ResolvedModel,
    config: ModelConfig,
    stages: list[PreparedStage],
    manager: PluginManager,
) -> tuple[PipelinePlan, dict[str, Any]]:
    """Every stage planned within what its GPU has left, and the ``--json`` keys
    (:func:`~kvspec_core.cli.gpu_report.gpu_report`); the caller has refused a ``--tp``
    vLLM refuses (``check_tp_accepted``)."""
    memory, gpu = gpu_memory(args)
    options = budget_options(args, memory)
    source = model_weights_source(resolved, config)
    budget = gpu_budget(source, resolved.config, tp=args.tp, **options)
    if not budget.fits:
        smallest = _smallest_tp_for_a_request(args, resolved, config, source, options, manager)
        raise weights_do_not_fit(
            budget, smallest, args.pp, source.unsplittable, tp_candidates(resolved.config)
        )
    try:
        pipeline = _plan_stages(stages, budget, manager)
    except CapacityError as error:
        smallest = _smallest_tp_for_a_request(args, resolved, config, source, options, manager)
        if smallest is None:
            raise
        raise CapacityError(
            f"{error}; or pass --tp {smallest}, the smallest TP at which one request of "
            f"max_model_len tokens fits next to the weights"
        ) from None
    return pipeline, gpu_report(pipeline, budget, gpu, source, vllm_downcast(config))


def gpu_plot_curves(
    args: argparse.Namespace,
    resolved: ResolvedModel,
    config: ModelConfig,
    dtypes: list[str],
    lengths: list[int],
    manager: PluginManager,
) -> dict[str, list[tuple[int, float | None]]]:
    """Concurrency against context length for each TP up to :data:`MAX_PLOTTED_TP` whose
    weights fit the GPU (one stage), one curve per TP (and per KV dtype when several are given)."""
    from kvspec_core.models.planning import concurrency_curve

    memory, _ = gpu_memory(args)
    options = budget_options(args, memory)
    source = model_weights_source(resolved, config)
    curves = {}
    for tp in [tp for tp in tp_candidates(resolved.config) if tp <= MAX_PLOTTED_TP]:
        budget = gpu_budget(source, resolved.config, tp=tp, **options)
        if not budget.fits:
            continue
        tp_args = argparse.Namespace(**{**vars(args), "tp": tp})
        for dtype in dtypes:
            label = f"TP {tp}" if len(dtypes) == 1 else f"TP {tp}, {dtype}"
            curves[label] = concurrency_curve(
                config,
                budget.kv_budget_bytes[0],
                plan_options(tp_args, dtype),
                manager,
                lengths,
                name=resolved.name,
                max_in_flight_tokens=args.max_in_flight_tokens,
            )
    return curves
