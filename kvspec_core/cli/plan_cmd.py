"""``kvspec plan MODEL --memory SIZE``: plan a model's KV cache within a byte budget.

``--gpu NAME`` (or ``--gpu-memory SIZE``) replaces ``--memory``: the KV budget is what the
GPU has left after the weights and overheads (:mod:`kvspec_core.cli.gpu_plan`; the extra
``--json`` keys are listed in :mod:`kvspec_core.cli.gpu_report`), and ``--plot`` draws one
curve per TP that fits.

``--kv-cache-dtype`` may be repeated: the plan (table or JSON) uses the first one, and
``--plot FILE`` draws one concurrency-vs-context-length curve per dtype given (``auto``
alone when none is given). ``--pp N`` splits the layers over N pipeline stages, each planned
within ``--memory`` on its own GPU; the report's plan is the stage that admits the fewest
requests, and ``pipeline_stages`` lists every stage.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import (
    add_gpu_arguments,
    add_model_arguments,
    add_pipeline_arguments,
    add_tier_arguments,
    check_max_model_len,
    check_tp_accepted,
    kv_cache_dtypes,
    offload_tier_error,
    offload_tier_options,
    plan_options,
    plot_file,
)
from kvspec_core.cli.gpu_options import check_budget_options, gpu_requested
from kvspec_core.cli.gpu_plan import MAX_PLOTTED_TP, gpu_plot_curves, plan_on_gpu
from kvspec_core.cli.gpu_text import gpu_lines
from kvspec_core.cli.gpu_weights import as_vllm_loads
from kvspec_core.cli.plan_report import pipeline_report, plan_report
from kvspec_core.cli.plan_text import describe_layers, render_plan
from kvspec_core.cli.sizes import parse_size
from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.catalog import ResolvedModel, resolve_model
from kvspec_core.models.normalized import ModelConfig, normalize_config
from kvspec_core.models.pipeline import (
    largest_fitting_max_model_len,
    plan_stages,
    split_stages,
)
from kvspec_core.models.planning import (
    concurrency_curve,
    context_lengths,
    prepare_model,
)
from kvspec_core.planner.tiers import OffloadTierError
from kvspec_core.plugins.manager import PluginManager

# Tests and benchmarks import ``describe_layers`` and ``plan_report`` from here.
__all__ = ["add_parser", "describe_layers", "plan_report", "run"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan a model's KV cache within a memory budget or on a GPU",
        description="Plan the KV cache of MODEL within --memory bytes, or within what a --gpu "
        "has left after the weights: groups, pools, blocks, padding and how many max-length "
        "requests fit at once.",
    )
    add_model_arguments(
        parser,
        memory_required=False,
        repeatable_kv_dtype=True,
        kv_dtype_help="KV-cache dtype (default auto: the model's dtype); repeat to plot "
        "several, the plan uses the first",
    )
    add_pipeline_arguments(parser)
    add_tier_arguments(parser)
    add_gpu_arguments(parser)
    parser.add_argument(
        "--plot",
        type=plot_file,
        metavar="FILE",
        help="write a PNG of max concurrency against context length, one "
        "curve per --kv-cache-dtype (with --gpu: per TP that fits) (needs kvspec-core[plot])",
    )
    parser.set_defaults(handler=run)


def _write_plot(
    args: argparse.Namespace,
    resolved: ResolvedModel,
    config: ModelConfig,
    budget: int,
    max_model_len: int,
    dtypes: list[str],
    manager: PluginManager,
) -> list[str]:
    """Draw the plot; the curve labels drawn."""
    from kvspec_core.cli.plot import plot_concurrency

    name = resolved.name
    lengths = context_lengths(max_model_len, args.block_size)
    if gpu_requested(args):
        curves = gpu_plot_curves(args, resolved, config, dtypes, lengths, manager)
        if curves:
            title = (
                f"{name} on {args.gpu or format_size(parse_size(args.gpu_memory))}: "
                "one curve per TP"
            )
            plot_concurrency(curves, args.plot, title=title, max_model_len=max_model_len)
        return list(curves)
    curves = {
        dtype: concurrency_curve(
            config,
            budget,
            plan_options(args, dtype),
            manager,
            lengths,
            name=name,
            max_in_flight_tokens=args.max_in_flight_tokens,
        )
        for dtype in dtypes
    }
    title = (
        f"{name}: {format_size(budget)} KV budget, block {args.block_size}, "
        f"TP {args.tp}, DCP {args.dcp}"
    )
    plot_concurrency(curves, args.plot, title=title, max_model_len=max_model_len)
    return list(curves)


def run(args: argparse.Namespace, manager: PluginManager) -> int:
    check_budget_options(args)
    budget = 0 if args.memory is None else parse_size(args.memory)
    dtypes = kv_cache_dtypes(args)
    if args.plot is None and len(dtypes) > 1:
        # Only --plot reads every value; a plan would silently take the first.
        raise ConfigError(
            f"--kv-cache-dtype is given {len(dtypes)} values ({', '.join(dtypes)}); a plan "
            "takes one: give one, or add --plot FILE.png to draw one curve per dtype"
        )
    if args.plot is not None:
        if args.pp > 1 or args.pp_partition is not None:
            raise ConfigError(
                "--plot draws single-stage plans; drop --pp / --pp-partition, or --plot"
            )
        from kvspec_core.cli.plot import load_pyplot

        load_pyplot()  # fail before planning when matplotlib is missing
    tier_options = offload_tier_options(args, "kvspec plan")
    resolved = resolve_model(args.model)
    check_tp_accepted(resolved.config, args.tp)
    config = normalize_config(resolved.config)
    if gpu_requested(args):
        config = as_vllm_loads(config)  # a float32 model runs in bfloat16 on the GPU
    prepared = prepare_model(
        config,
        plan_options(args, dtypes[0]),
        manager,
        name=resolved.name,
        max_model_len=args.max_model_len,
        max_in_flight_tokens=args.max_in_flight_tokens,
        **tier_options,
    )
    check_max_model_len(prepared.model, args)
    stages = split_stages(prepared, args.pp, args.pp_partition)
    gpu_report: dict[str, Any] = {}
    try:
        if gpu_requested(args):
            pipeline, gpu_report = plan_on_gpu(args, resolved, config, stages, manager)
        else:
            pipeline = plan_stages(stages, budget, manager)
    except OffloadTierError as error:
        raise offload_tier_error(error) from None
    except CapacityError as error:
        if gpu_report or gpu_requested(args):
            if args.plot is None:
                raise
            # The plot draws every TP that fits, whether or not --tp does.
            drawn = _write_plot(
                args, resolved, config, budget, prepared.context.max_model_len, dtypes, manager
            )
            where = (
                f"--plot drew {', '.join(drawn)} in {args.plot}"
                if drawn
                else f"--plot: no TP up to {MAX_PLOTTED_TP} fits, nothing drawn"
            )
            raise CapacityError(f"{error}; {where}") from None
        largest = largest_fitting_max_model_len(stages, budget, manager)
        if largest:
            raise CapacityError(f"{error} (pass --max-model-len {largest})") from None
        raise
    result = pipeline.bottleneck.result
    report = plan_report(result, source=resolved.source)
    report.update(pipeline_report(pipeline, args.pp))
    report.update(gpu_report)
    if args.plot is not None:
        _write_plot(args, resolved, config, budget, result.context.max_model_len, dtypes, manager)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_plan(report))
        if gpu_report:
            print("\n" + "\n".join(gpu_lines(report)))
        if args.plot is not None:
            print(f"plot             {args.plot}")
    return 0
