"""Plan and materialise a 1,000-layer hybrid model; print the time each step takes.

The model interleaves full attention, sliding-window and Mamba state layers, using the real
kvspec-sliding-window and kvspec-mamba specs (installed by scripts/dev-setup). The budget is
small (256 MiB by default) so materialising stays cheap on a laptop. Usage::

    python benchmarks/plan_large_model.py [--layers 1000] [--budget-mib 256] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kvspec_core import FullAttentionSpec, KVSpec, SizingContext, load_plugins
from kvspec_core.cli.arguments import positive_int
from kvspec_core.planner import materialize, plan_kv_cache
from kvspec_mamba import MambaSpec
from kvspec_sliding_window import SlidingWindowSpec


def build_model(num_layers: int) -> dict[str, KVSpec]:
    """Per ten layers: one full attention, three sliding-window, six Mamba state layers."""
    common = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    full = FullAttentionSpec(**common)
    window = SlidingWindowSpec(sliding_window=128, **common)
    state = MambaSpec(block_size=16, shapes=((8192,),), dtypes=(torch.float16,))  # 16 KiB
    pattern = [full, window, state, state, window, state, state, window, state, state]
    return {f"model.layers.{i}": pattern[i % len(pattern)] for i in range(num_layers)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=1000)
    parser.add_argument("--budget-mib", type=positive_int, default=256)
    parser.add_argument("--max-model-len", type=positive_int, default=1024)
    parser.add_argument("--layout", default="LBHNC")
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    manager = load_plugins({"KVSPEC_PLUGINS": "sliding_window,mamba"})
    specs = build_model(args.layers)
    ctx = SizingContext(
        max_model_len=args.max_model_len, max_in_flight_tokens=256, mamba_cache_mode="align"
    )
    budget = args.budget_mib << 20

    plan_times, view_times = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        plan = plan_kv_cache(specs, budget, ctx, manager, layout=args.layout)
        plan_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        buffers = materialize(plan)
        view_times.append(time.perf_counter() - start)
        assert len(buffers.views) == args.layers
        del buffers
    result = {
        "layers": args.layers,
        "layout": args.layout,
        "budget_bytes": budget,
        "max_model_len": args.max_model_len,
        "groups": len(plan.groups),
        "pools": [
            {"num_blocks": p.num_blocks, "block_bytes": p.block_bytes, "groups": len(p.groups)}
            for p in plan.pools
        ],
        "num_blocks": plan.num_blocks,
        "max_concurrency": plan.max_concurrency,
        "bytes_allocated": plan.bytes_allocated,
        "bytes_padding": plan.bytes_padding,
        "plan_seconds_median": statistics.median(plan_times),
        "materialize_seconds_median": statistics.median(view_times),
        "repeat": args.repeat,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.layers} layers, {len(plan.groups)} groups, {len(plan.pools)} pools, "
            f"{plan.num_blocks} blocks, concurrency {plan.max_concurrency:.2f}, "
            f"{plan.bytes_allocated} bytes allocated, {plan.bytes_padding} bytes padding"
        )
        print(
            f"plan:        {result['plan_seconds_median'] * 1e3:8.1f} ms (median of {args.repeat})"
        )
        print(
            f"materialize: {result['materialize_seconds_median'] * 1e3:8.1f} ms "
            f"(median of {args.repeat})"
        )
    return result


if __name__ == "__main__":
    main()
