"""The human ``kvspec simulate`` output, rendered from its ``--json`` document
(:mod:`kvspec_core.cli.simulate_report`): the replay's figures, one row per tier when there
are offload tiers, and ``--plot``'s host-memory sweep."""

from __future__ import annotations

from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.table import render_table


def _figure_rows(document: dict[str, Any], trace_label: str) -> list[tuple[str, str]]:
    """The replay's figures: what was replayed on what, hits, peak usage, waits."""
    return [
        ("model", document["model"]),
        ("trace", trace_label),
        ("KV budget", format_size(document["kv_budget_bytes"])),
        ("groups", ", ".join(document["groups"])),
        ("blocks (all pools)", f"{document['num_blocks']:,}"),
        (
            "requests",
            f"{document['requests']:,} ({document['admitted']:,} admitted, "
            f"{document['never_admitted']:,} never admitted, {document['rejected']:,} over the "
            "admission cap"
            + (
                f", {document['truncated']:,} cut short at max_model_len"
                if document.get("truncated")
                else ""
            )
            + ")",
        ),
        ("events replayed", f"{document['events']:,} in {document['seconds']:.2f} s"),
        (
            "prefix-hit rate",
            f"{document['prefix_hit_rate']:.1%} ({document['hit_tokens']:,} of "
            f"{document['prompt_tokens']:,} prompt tokens)",
        ),
        (
            "peak usage",
            f"{document['peak_usage']:.1%} ({document['peak_used_blocks']:,} of "
            f"{document['usable_blocks']:,} blocks)",
        ),
        *_pool_peak_rows(document),
        (
            "longest request",
            f"{document['longest_request_tokens']:,} tokens (max_model_len "
            f"{document['max_model_len']:,})",
        ),
        (
            "admissions that waited",
            f"{document['waited_admissions']:,} ({document['wait_retries']:,} retries)",
        ),
        (
            "preemptions",
            f"{document['preemptions']:,} ({document['readmissions']:,} re-admitted, "
            f"{document['readmission_hit_tokens']:,} of the hit tokens theirs)",
        ),
        ("decodes while queued", f"{document['dropped_decodes']:,} (dropped)"),
    ]


def _pool_peak_rows(document: dict[str, Any]) -> list[tuple[str, str]]:
    """With several pools, each one's own peak (the overall one can hide a full pool)."""
    peaks, usable = document["peak_used_blocks_by_pool"], document["usable_blocks_by_pool"]
    if len(peaks) < 2:
        return []
    return [
        (
            f"  pool {index}",
            f"{peak / count if count else 0.0:.1%} ({peak:,} of {count:,} blocks)",
        )
        for index, (peak, count) in enumerate(zip(peaks, usable, strict=True))
    ]


def _tier_table(document: dict[str, Any]) -> str:
    """One row per tier, the device first: blocks, hit tokens, what moved, load waits."""
    blocks = [document["num_blocks"], *document["tier_blocks"].values()]
    hits = document["hit_tokens"] or 1
    rows = [
        [
            tier["name"],
            f"{count:,}",
            f"{tier['hit_tokens']:,} ({tier['hit_tokens'] / hits:.1%})",
            f"{tier['loaded_blocks']:,} ({format_size(tier['loaded_bytes'])})",
            f"{tier['stored_blocks']:,} ({format_size(tier['stored_bytes'])})",
            f"{tier['demoted_blocks']:,} ({format_size(tier['demoted_bytes'])})",
            f"{tier['load_waits']:,}",
        ]
        for tier, count in zip(document["tiers"], blocks, strict=True)
    ]
    return render_table(
        (
            "tier",
            "blocks",
            "hit tokens",
            "loaded to device",
            "stored into",
            "demoted from",
            "load waits",
        ),
        rows,
        align_right=(1, 2, 3, 4, 5, 6),
    )


def _sweep_table(sweep: list[dict[str, Any]]) -> str:
    """``--plot``'s replays: host memory and blocks, hit tokens and rate of each."""
    return render_table(
        ("host memory", "host blocks", "hit tokens", "prefix-hit rate"),
        [
            [
                format_size(point["host_memory_bytes"]),
                f"{point['host_blocks']:,}",
                f"{point['hit_tokens']:,}",
                f"{point['prefix_hit_rate']:.1%}",
            ]
            for point in sweep
        ],
        align_right=(0, 1, 2, 3),
    )


def render_simulation(document: dict[str, Any], trace_label: str) -> str:
    """The human report of a ``kvspec simulate`` document; ``trace_label`` names the trace
    (built-in with its seed, or a file and the requests left out)."""
    parts = [render_table(("figure", "value"), _figure_rows(document, trace_label))]
    if document["tier_blocks"]:
        parts += ["", _tier_table(document)]
    if "host_memory_sweep" in document:
        parts += ["", _sweep_table(document["host_memory_sweep"]), f"plot: {document['plot']}"]
    return "\n".join(parts)
