"""``kvspec plan MODEL --memory SIZE``: plan a model's KV cache within a byte budget.

``--gpu NAME`` (or ``--gpu-memory SIZE``) replaces ``--memory``: the KV budget is what the
GPU has left after the weights and overheads (:mod:`kvspec_core.cli.gpu_plan`, which lists
the extra ``--json`` keys), and ``--plot`` draws one curve per TP that fits.

``--kv-cache-dtype`` may be repeated: the plan (table or JSON) uses the first one, and
``--plot FILE`` draws one concurrency-vs-context-length curve per dtype given (``auto``
alone when none is given). ``--pp N`` splits the layers over N pipeline stages, each planned
within ``--memory`` on its own GPU; the report's plan is the stage that admits the fewest
requests, and ``pipeline_stages`` lists every stage.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import (
    DEFAULT_KV_CACHE_DTYPE,
    add_gpu_arguments,
    add_model_arguments,
    add_pipeline_arguments,
    add_tier_arguments,
    offload_tier_error,
    offload_tier_options,
    plan_options,
    plot_file,
)
from kvspec_core.cli.gpu_plan import (
    MAX_PLOTTED_TP,
    as_vllm_loads,
    check_budget_options,
    gpu_lines,
    gpu_plot_curves,
    gpu_requested,
    plan_on_gpu,
)
from kvspec_core.cli.sizes import parse_size
from kvspec_core.cli.table import render_table
from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.catalog import ResolvedModel, resolve_model
from kvspec_core.models.normalized import ModelConfig, normalize_config
from kvspec_core.models.pipeline import (
    PipelinePlan,
    largest_fitting_max_model_len,
    plan_stages,
    split_stages,
)
from kvspec_core.models.planning import (
    ModelPlan,
    concurrency_curve,
    context_lengths,
    prepare_model,
)
from kvspec_core.planner.plan import KVCachePlan, PlannedGroup
from kvspec_core.planner.tiers import OffloadTierError
from kvspec_core.plugins.manager import PluginManager


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


def _tokens_per_request(group: PlannedGroup) -> int | None:
    """Token positions one max-length request keeps in ``group`` (block granularity);
    ``None`` for state families (Mamba), whose blocks hold a state, not tokens."""
    try:
        tokens_per_state = group.layer_specs[0].tokens_per_state
    except NotImplementedError:
        return None
    if tokens_per_state <= 0:
        return None
    return group.blocks_per_request * group.block_size


def _pool_tokens(plan: KVCachePlan, pool_id: int, blocks: int) -> int | None:
    """Tokens ``blocks`` blocks of pool ``pool_id`` hold, its null block left out; ``None``
    for a state pool (Mamba) or one whose groups' blocks hold different token counts."""
    sizes = {
        group.block_size if _tokens_per_request(group) is not None else None
        for group in plan.groups
        if group.pool == pool_id
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
        "model_dtype": str(result.model.layers[0].model_dtype).removeprefix("torch."),
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
                "tokens_per_request": _tokens_per_request(group),
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


_INDEX = re.compile(r"^(?P<prefix>.*?)(?P<index>\d+)(?P<suffix>(?:\.\D.*)?)$")


def describe_layers(names: Sequence[str]) -> str:
    """``32 × model.layers.0..31`` style summary of layer names (human output only)."""
    matches = [_INDEX.match(name) for name in names]
    if not names or any(m is None for m in matches):
        return f"{len(names)} layers"
    shapes = {(m["prefix"], m["suffix"]) for m in matches if m is not None}
    if len(shapes) != 1:
        return f"{len(names)} layers"
    prefix, suffix = shapes.pop()
    indices = [int(m["index"]) for m in matches if m is not None]
    if len(indices) == 1:
        return f"1 × {names[0]}"
    steps = {b - a for a, b in pairwise(indices)}
    if len(steps) == 1:
        step = steps.pop()
        stride = f" step {step}" if step != 1 else ""
        span = f"{indices[0]}..{indices[-1]}{stride}"
    else:
        shown = ",".join(map(str, indices[:6])) + (",…" if len(indices) > 6 else "")
        span = "{" + shown + "}"
    return f"{len(names)} × {prefix}{span}{suffix}"


def _human(report: dict[str, Any]) -> str:
    group_rows = [
        [
            g["id"],
            g["kind"],
            describe_layers(g["layers"]),
            g["block_size"],
            f"{g['page_size_bytes']:,}",
            f"{g['blocks_per_request']:,}",
            "-" if g["tokens_per_request"] is None else f"{g['tokens_per_request']:,}",
            g["pool"],
        ]
        for g in report["groups"]
    ]
    pool_rows = [
        [
            p["id"],
            f"{p['num_blocks']:,}",
            f"{p['block_bytes']:,}",
            f"{p['blocks_per_request']:,}",
            f"{p['max_concurrency']:.2f}",
            "host" if p["host_resident"] else "device",
        ]
        for p in report["pools"]
    ]
    budget = report["kv_budget_bytes"]
    padding_share = report["bytes_padding"] / budget * 100 if budget else 0.0
    pipelined = report["pipeline_parallel_size"] > 1
    lines = [
        f"model            {report['model']} ({report['source']})",
        f"KV budget        {format_size(budget)} ({budget:,} B)"
        + (" per stage" if pipelined else "")
        + f"; KV dtype {report['kv_cache_dtype']} (model {report['model_dtype']}); block size "
        f"{report['block_size']}; TP {report['tensor_parallel_size']}; DCP "
        f"{report['decode_context_parallel_size']}"
        + (f"; PP {report['pipeline_parallel_size']}" if pipelined else ""),
        f"max model len    {report['max_model_len']:,} tokens; in-flight tokens "
        f"{report['max_in_flight_tokens']:,}"
        + (
            f"; encoder tokens {report['max_encoder_tokens']:,}"
            if report["max_encoder_tokens"]
            else ""
        ),
        "",
    ]
    if pipelined:
        lines += _stage_lines(report)
    lines += [
        render_table(
            [
                "group",
                "kind",
                "layers",
                "block",
                "page bytes",
                "blocks/request",
                "tokens/request",
                "pool",
            ],
            group_rows,
            align_right=(3, 4, 5, 6),
        ),
        "",
        render_table(
            ["pool", "blocks", "block bytes", "blocks/request", "max concurrency", "memory"],
            pool_rows,
            align_right=(1, 2, 3, 4),
        ),
        "",
        f"blocks           {report['num_blocks']:,} (one null block per pool included)",
        f"memory used      {format_size(report['bytes_allocated'])} of {format_size(budget)}; "
        f"padding {format_size(report['bytes_padding'])} ({padding_share:.2f}% of the budget)",
        f"KV per request   {format_size(report['kv_bytes_per_request'])} at "
        f"{report['max_model_len']:,} tokens ({report['kv_bytes_per_token']:,.1f} B per token)",
        f"max concurrency  {report['max_concurrency']:.2f} requests of "
        f"{report['max_model_len']:,} tokens"
        + (f" (the least over {len(report['pipeline_stages'])} stages)" if pipelined else ""),
    ]
    if report["memoryless_layers"]:
        lines.append(
            f"no cache         {describe_layers(report['memoryless_layers'])}"
            + (" (every stage)" if pipelined else "")
        )
    if report["tiers"]:
        lines += ["", *_tier_lines(report)]
    return "\n".join(lines)


def _tier_lines(report: dict[str, Any]) -> list[str]:
    """The offload tiers: blocks and tokens per pool, then each tier's totals."""
    rows = [
        [
            tier["name"],
            pool["pool"],
            f"{pool['num_blocks']:,}" if pool["num_blocks"] else "-",
            "-" if pool["tokens"] is None else f"{pool['tokens']:,}",
            format_size(pool["num_blocks"] * block["block_bytes"]),
        ]
        for tier in report["tiers"]
        for pool, block in zip(tier["pools"], report["pools"], strict=True)
    ]
    table = render_table(
        ["tier", "pool", "blocks", "tokens", "memory"], rows, align_right=(2, 3, 4)
    )
    totals = [
        f"{tier['name'] + ' tier':<17}{tier['num_blocks']:,} blocks, "
        f"{format_size(tier['bytes_allocated'])} of {format_size(tier['budget_bytes'])}"
        + (f" in {tier['path']}" if tier["path"] else "")
        + f"; {tier['max_concurrency']:.2f} requests of {report['max_model_len']:,} tokens"
        for tier in report["tiers"]
    ]
    return [table, "", *totals]


def _stage_lines(report: dict[str, Any]) -> list[str]:
    """The per-stage table of a pipelined plan, then a line introducing the tightest stage."""
    rows = [
        [
            stage["stage"],
            f"{stage['layer_range'][0]}..{stage['layer_range'][1] - 1}",
            stage["cache_layers"],
            f"{stage['num_blocks']:,}",
            format_size(stage["bytes_allocated"]),
            format_size(stage["kv_bytes_per_request"]),
            f"{stage['max_concurrency']:.2f}",
        ]
        for stage in report["pipeline_stages"]
    ]
    table = render_table(
        [
            "stage",
            "layers",
            "cache layers",
            "blocks",
            "memory used",
            "KV per request",
            "max concurrency",
        ],
        rows,
        align_right=(2, 3, 4, 5, 6),
    )
    return [
        table,
        "",
        f"stage {report['bottleneck_stage']} admits the fewest requests; its plan:",
        "",
    ]


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
    dtypes = list(dict.fromkeys(args.kv_cache_dtype or [DEFAULT_KV_CACHE_DTYPE]))
    if args.plot is not None:
        if args.pp > 1 or args.pp_partition is not None:
            raise ConfigError(
                "--plot draws single-stage plans; drop --pp / --pp-partition, or --plot"
            )
        from kvspec_core.cli.plot import load_pyplot

        load_pyplot()  # fail before planning when matplotlib is missing
    tier_options = offload_tier_options(args, "kvspec plan")
    resolved = resolve_model(args.model)
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
        print(_human(report))
        if gpu_report:
            print("\n" + "\n".join(gpu_lines(report)))
        if args.plot is not None:
            print(f"plot             {args.plot}")
    return 0
