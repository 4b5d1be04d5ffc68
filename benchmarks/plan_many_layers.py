"""Time each step of ``kvspec plan`` for a real config stretched to many layers.

A bundled preset's ``num_hidden_layers`` is overridden (its layer pattern repeats), then the
steps ``kvspec plan`` takes are timed one by one: typing the layers (``model_layers``),
asking the plugins for specs (``layer_specs``), planning (``plan_kv_cache``) and building
the report the CLI prints. Usage::

    python benchmarks/plan_many_layers.py [--layers 100000] [--preset llama-3.1-8b]
        [--memory 4TiB] [--max-model-len 4096] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from kvspec_core import load_plugins
from kvspec_core.cli.arguments import positive_int
from kvspec_core.cli.plan_cmd import plan_report
from kvspec_core.cli.sizes import parse_size
from kvspec_core.models.catalog import load_preset
from kvspec_core.models.ingest import default_sizing_context, layer_specs, model_layers
from kvspec_core.models.planning import ModelPlan
from kvspec_core.planner import plan_kv_cache
from kvspec_core.plugins.layer_config import PlanOptions

T = TypeVar("T")


def timed(step: Callable[[], T]) -> tuple[T, float]:
    """``step()`` and the CPU seconds it took: CPU time, not wall time, so that the figure
    does not depend on what else the machine runs (a single-threaded step)."""
    start = time.process_time()
    result = step()
    return result, time.process_time() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=100_000)
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--memory", default="4TiB")
    parser.add_argument("--max-model-len", type=positive_int, default=4096)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    manager = load_plugins()
    model_layers(load_preset(args.preset), PlanOptions(), manager)  # imports happen once
    config = {**load_preset(args.preset), "num_hidden_layers": args.layers}
    budget = parse_size(args.memory)
    options = PlanOptions()
    steps: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        model, seconds = timed(lambda: model_layers(config, options, manager, name=args.preset))
        steps.setdefault("model_layers", []).append(seconds)
        specs, seconds = timed(partial(layer_specs, model, manager))
        steps.setdefault("layer_specs", []).append(seconds)
        ctx = default_sizing_context(model, max_model_len=args.max_model_len)
        plan, seconds = timed(partial(plan_kv_cache, specs, budget, ctx, manager))
        steps.setdefault("plan_kv_cache", []).append(seconds)
        result = ModelPlan(model=model, specs=specs, context=ctx, plan=plan)
        _, seconds = timed(partial(plan_report, result, source="preset"))
        steps.setdefault("plan_report", []).append(seconds)
    medians = {step: statistics.median(times) for step, times in steps.items()}
    report = {
        "preset": args.preset,
        "layers": args.layers,
        "groups": len(plan.groups),
        "pools": len(plan.pools),
        "num_blocks": plan.num_blocks,
        "median_cpu_seconds": medians,
        "total_median_seconds": sum(medians.values()),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{args.preset} stretched to {args.layers:,} layers: {len(plan.groups)} groups, "
            f"{len(plan.pools)} pools, {plan.num_blocks:,} blocks "
            f"(CPU time, median of {args.repeat} runs)"
        )
        for step, seconds in medians.items():
            print(f"  {step:<14} {seconds * 1000:10.1f} ms")
        print(f"  {'total':<14} {report['total_median_seconds'] * 1000:10.1f} ms")
    return report


if __name__ == "__main__":
    main()
