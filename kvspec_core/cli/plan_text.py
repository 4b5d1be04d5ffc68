"""The human ``kvspec plan`` report, rendered from its ``--json`` document
(:mod:`kvspec_core.cli.plan_report`): header, pipeline stages, groups and pools tables, totals,
offload tiers."""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.table import render_table

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


def render_plan(report: dict[str, Any]) -> str:
    """The report without ``--gpu``'s lines: what ``kvspec plan`` prints."""
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
