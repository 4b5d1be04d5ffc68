"""``kvspec plan MODEL --gpu NAME``: the KV budget is what one GPU has left after the weights
it holds and vLLM's overheads (:mod:`kvspec_core.deployment`), then the usual plan.

Extra ``--json`` keys (the plan's keys stay; ``kv_budget_bytes`` is then the bottleneck
stage's budget):

* ``gpu``: ``name`` (catalog name, or ``custom`` with ``--gpu-memory`` alone),
  ``description``, ``memory_bytes``, ``memory_source``, ``utilization``, ``usable_bytes``
  (``floor(memory_bytes x utilization)``);
* ``weights``: ``source`` (``safetensors index``, ``safetensors header`` or ``parameter
  count``), ``checkpoint_bytes`` (the whole model as stored; as loaded when ``loaded_as``
  is set), ``parameters`` (transformers' count, or null), ``quant_method`` (or null),
  ``path`` (the metadata file read, or null),
  ``loaded_as`` (null, or why vLLM holds the weights in a narrower dtype than the config's:
  a float32 model is loaded, and its ``auto`` KV cache stored, in bfloat16, so its weights
  are its parameters at 2 bytes, not the checkpoint's float32 size);
* ``overheads``: ``activation_bytes``, ``non_torch_bytes`` (per GPU), ``basis``, ``source``;
* ``memory_per_gpu``: per pipeline stage, ``stage``, ``weights_bytes``, ``activation_bytes``,
  ``non_torch_bytes``, ``kv_budget_bytes``, ``kv_bytes_allocated``, ``free_bytes`` (usable
  bytes the plan leaves: padding below one block) and ``reserved_bytes`` (the share
  ``--gpu-memory-utilization`` keeps back);
* ``max_tokens``: ``max_concurrency x max_model_len``, the tokens the tightest stage holds
  for requests of that length.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import attrs
import torch

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import DEFAULT_KV_CACHE_DTYPE, plan_options
from kvspec_core.cli.ascii_numbers import match_ascii_decimal
from kvspec_core.cli.sizes import UNITS, parse_size
from kvspec_core.cli.table import render_table
from kvspec_core.deployment.checkpoint import CheckpointSize, folder_checkpoint, hub_checkpoint
from kvspec_core.deployment.gpu_budget import (
    DEFAULT_UTILIZATION,
    GpuBudget,
    WeightsSource,
    gpu_budget,
    tp_candidates,
    tp_refusal,
    weights_do_not_fit,
    weights_source,
)
from kvspec_core.deployment.gpus import MIB, find_gpu
from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.catalog import ResolvedModel
from kvspec_core.models.fields import model_dtype
from kvspec_core.models.hub import hub_cache_dir, parse_hub_id
from kvspec_core.models.layer_typing import num_layers
from kvspec_core.models.normalized import ModelConfig
from kvspec_core.models.pipeline import PipelinePlan, PreparedStage, StagePlan, split_stages
from kvspec_core.models.planning import prepare_model
from kvspec_core.plugins.manager import PluginManager

#: Largest TP ``--plot`` draws with ``--gpu``: one node of eight GPUs.
MAX_PLOTTED_TP = 8


def gpu_requested(args: argparse.Namespace) -> bool:
    """Whether the KV budget comes from a GPU (``--gpu`` or ``--gpu-memory``)."""
    return args.gpu is not None or args.gpu_memory is not None


def check_budget_options(args: argparse.Namespace) -> None:
    """Exactly one of ``--memory`` (the KV budget) and ``--gpu`` / ``--gpu-memory`` (the GPU
    it is derived from); the GPU-only options only with a GPU."""
    if args.memory is not None and gpu_requested(args):
        raise ConfigError(
            "--memory is the KV budget itself and --gpu / --gpu-memory derive it from the GPU; "
            "give one of them"
        )
    if args.memory is None and not gpu_requested(args):
        raise ConfigError(
            "kvspec plan needs --memory SIZE (the KV-cache budget, e.g. 40GiB) or --gpu NAME "
            "(the budget a GPU has left after the weights, e.g. --gpu h100-80gb)"
        )
    if not gpu_requested(args):
        for option, value in (
            ("--gpu-memory-utilization", args.gpu_memory_utilization),
            ("--overhead", args.overhead),
        ):
            if value is not None:
                raise ConfigError(f"{option} applies to --gpu / --gpu-memory; add --gpu NAME")


def _checkpoint(resolved: ResolvedModel) -> CheckpointSize | None:
    if resolved.path is None:
        return None  # a preset: configs only; its weights are counted from parameters
    if resolved.source == "hub cache":
        hub_id = parse_hub_id(resolved.name)
        if hub_id is not None:
            return hub_checkpoint(hub_id[0], hub_id[1], hub_cache_dir())
    folder = resolved.path if resolved.path.is_dir() else resolved.path.parent
    return folder_checkpoint(folder)


def _memory(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    if args.gpu_memory is not None:
        memory = parse_size(args.gpu_memory, what="--gpu-memory")
        gpu = find_gpu(args.gpu) if args.gpu is not None else None
        return memory, {
            "name": gpu.name if gpu else "custom",
            "description": gpu.description if gpu else "a GPU of --gpu-memory",
            "memory_bytes": memory,
            "memory_source": "--gpu-memory",
        }
    gpu = find_gpu(args.gpu)
    return gpu.memory_bytes, {
        "name": gpu.name,
        "description": gpu.description,
        "memory_bytes": gpu.memory_bytes,
        "memory_source": gpu.source,
    }


def _budget_options(args: argparse.Namespace, memory: int) -> dict[str, Any]:
    return {
        "memory_bytes": memory,
        "utilization": DEFAULT_UTILIZATION
        if args.gpu_memory_utilization is None
        else args.gpu_memory_utilization,
        "pp": args.pp,
        "partition": args.pp_partition,
        "overhead_bytes": None if args.overhead is None else _overhead_bytes(args.overhead),
    }


def _overhead_bytes(text: str) -> int:
    """``--overhead``: a size, or zero (to compare against an engine log whose overheads
    are already folded into ``--gpu-memory``)."""
    stripped = text.strip(" \t")
    number = match_ascii_decimal(stripped)
    unit = stripped[number[1] :].strip(" \t").lower() or "b" if number is not None else None
    if number is not None and number[0] == 0 and unit in UNITS:
        return 0
    return parse_size(text, what="--overhead")  # a size, or the error naming what is wrong


def as_vllm_loads(config: ModelConfig) -> ModelConfig:
    """``config`` with the dtype vLLM runs it in: ``--dtype auto`` downcasts a float32 model
    to the platform's first supported dtype (``_resolve_auto_dtype`` in vLLM's
    ``config/model.py``), bfloat16 on every GPU of the catalog (compute capability 8.0 or
    more); the weights are then held, and the ``auto`` KV cache stored, in bfloat16."""
    if config.dtype != torch.float32:
        return config
    return attrs.evolve(config, dtype=torch.bfloat16)


def _downcast(config: ModelConfig) -> str | None:
    if model_dtype(config.fields) != torch.float32:
        return None
    return "vLLM loads this float32 model in bfloat16 (--dtype auto downcasts float32)"


def model_weights_source(resolved: ResolvedModel, config: ModelConfig) -> WeightsSource:
    """Where the model's weights are counted from (its checkpoint metadata, else its
    parameters), in the dtype vLLM loads them in (``config``: as :func:`as_vllm_loads`
    gives it)."""
    return weights_source(
        resolved.config,
        num_layers(config.fields),
        config.dtype.itemsize,
        _checkpoint(resolved),
        downcast=_downcast(config),
    )


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
            plan_options(argparse.Namespace(**{**vars(args), "tp": budget.tp}), _first_dtype(args)),
            manager,
            name=resolved.name,
            max_model_len=args.max_model_len,
            max_in_flight_tokens=args.max_in_flight_tokens,
        )
        _plan_stages(split_stages(prepared, args.pp, args.pp_partition), budget, manager)
    except (CapacityError, ConfigError):
        return False
    return True


def _first_dtype(args: argparse.Namespace) -> str:
    dtypes = args.kv_cache_dtype
    if isinstance(dtypes, list):
        return str(dtypes[0]) if dtypes else DEFAULT_KV_CACHE_DTYPE
    return str(dtypes or DEFAULT_KV_CACHE_DTYPE)


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
    """Every stage planned within what its GPU has left, and the ``--json`` keys above."""
    refusal = tp_refusal(resolved.config, args.tp)
    if refusal is not None:
        accepted = ", ".join(map(str, tp_candidates(resolved.config)))
        raise ConfigError(
            f"--tp {args.tp}: vLLM refuses it for this model ({refusal}); it accepts {accepted}"
        )
    memory, gpu = _memory(args)
    options = _budget_options(args, memory)
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
    allocated = {stage.stage: stage.result.plan.bytes_allocated for stage in pipeline.stages}
    overheads = budget.overheads
    result = pipeline.bottleneck.result
    report = {
        "kv_budget_bytes": budget.kv_budget_bytes[pipeline.bottleneck.stage],
        "gpu": {**gpu, "utilization": budget.utilization, "usable_bytes": budget.usable_bytes},
        "weights": {
            "source": source.kind,
            "loaded_as": _downcast(config),
            "checkpoint_bytes": source.checkpoint_bytes,
            "parameters": source.parameters,
            "quant_method": source.quant_method,
            "path": source.path,
        },
        "overheads": {
            "activation_bytes": overheads.activation_bytes,
            "non_torch_bytes": overheads.non_torch_bytes,
            "basis": overheads.basis,
            "source": overheads.source,
        },
        "memory_per_gpu": [
            {
                "stage": stage,
                "weights_bytes": weights,
                "activation_bytes": overheads.activation_bytes,
                "non_torch_bytes": overheads.non_torch_bytes,
                "kv_budget_bytes": kv_budget,
                "kv_bytes_allocated": allocated.get(stage, 0),
                "free_bytes": kv_budget - allocated.get(stage, 0),
                "reserved_bytes": budget.memory_bytes - budget.usable_bytes,
            }
            for stage, (weights, kv_budget) in enumerate(
                zip(budget.weights_bytes, budget.kv_budget_bytes, strict=True)
            )
        ],
        "max_tokens": math.floor(result.plan.max_concurrency * result.context.max_model_len),
    }
    return pipeline, report


def gpu_lines(report: dict[str, Any]) -> list[str]:
    """The memory breakdown per GPU and the answer (human output)."""
    gpu, weights = report["gpu"], report["weights"]
    stages = report["memory_per_gpu"]
    overridden = report["overheads"]["basis"] == "--overhead"
    rows = [
        ("weights", "weights_bytes"),
        ("--overhead" if overridden else "activation peak", "activation_bytes"),
        ("non-torch", "non_torch_bytes"),
        ("KV cache", "kv_bytes_allocated"),
        ("free (under one block)", "free_bytes"),
        (f"held back (1 - {gpu['utilization']:g})", "reserved_bytes"),
    ]
    headers = ["memory per GPU"] + (
        [f"stage {s['stage']}" for s in stages] if len(stages) > 1 else ["bytes", "share"]
    )
    table_rows = []
    for label, key in rows:
        if len(stages) > 1:
            table_rows.append([label, *(format_size(s[key]) for s in stages)])
        else:
            value = stages[0][key]
            table_rows.append([label, format_size(value), f"{value / gpu['memory_bytes']:.1%}"])
    count = (
        f"{weights['parameters']:,} parameters"
        if weights["parameters"] is not None
        else "parameters not counted"
    )
    stored = f"; {weights['quant_method']} as stored" if weights["quant_method"] else ""
    if weights["loaded_as"]:
        stored += f"; {weights['loaded_as']}"
    tp = report["tensor_parallel_size"]
    pp = report["pipeline_parallel_size"]
    return [
        f"GPU              {gpu['name']} ({gpu['description']}): "
        f"{format_size(gpu['memory_bytes'])} ({gpu['memory_bytes'] / MIB:,.0f} MiB) x "
        f"{gpu['utilization']:g} = "
        f"{format_size(gpu['usable_bytes'])} per GPU; TP {tp}"
        + (f" x PP {pp}" if pp > 1 else "")
        + f" = {tp * pp} GPU{'s' if tp * pp > 1 else ''}",
        f"weights          {format_size(weights['checkpoint_bytes'])} in all, from the "
        f"{weights['source']} ({count}{stored})",
        f"overheads        {report['overheads']['basis']}; {report['overheads']['source']}",
        "",
        render_table(headers, table_rows, align_right=tuple(range(1, len(headers)))),
        "",
        f"answer           {report['max_concurrency']:.2f} requests of "
        f"{report['max_model_len']:,} tokens at once ({report['max_tokens']:,} tokens)",
    ]


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

    memory, _ = _memory(args)
    options = _budget_options(args, memory)
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
