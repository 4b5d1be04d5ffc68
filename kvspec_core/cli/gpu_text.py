"""The human breakdown of ``kvspec plan --gpu``: the GPU, the weights and overheads, the
memory per GPU (per pipeline stage) and the answer, rendered from what
:mod:`kvspec_core.cli.gpu_report` adds to the ``--json`` document."""

from __future__ import annotations

from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.table import render_table
from kvspec_core.deployment.gpus import MIB


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
        f"{weights['source']} ({count}{stored})"
        + (f"; assumed: {weights['assumed']}" if weights["assumed"] else ""),
        f"overheads        {report['overheads']['basis']}; {report['overheads']['source']}",
        "",
        render_table(headers, table_rows, align_right=tuple(range(1, len(headers)))),
        "",
        f"answer           {report['max_concurrency']:.2f} requests of "
        f"{report['max_model_len']:,} tokens at once ({report['max_tokens']:,} tokens)",
    ]
