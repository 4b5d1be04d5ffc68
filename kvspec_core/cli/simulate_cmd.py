"""``kvspec simulate MODEL --memory SIZE``: replay a request trace through the plan's allocator.

Plans MODEL exactly as ``kvspec plan`` does, builds the runtime allocator from that plan
(admission caps are the planner's own formulas), and replays the deterministic benchmark
trace (:mod:`kvspec_core.runtime.trace`) through it: prefix-hit rate, peak block usage, and
how many admissions had to wait for blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import add_model_arguments, plan_options, positive_int, seed
from kvspec_core.cli.sizes import parse_size
from kvspec_core.cli.table import render_table
from kvspec_core.models.catalog import resolve_model
from kvspec_core.models.planning import prepare_model
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime.allocator import KVCacheAllocator
from kvspec_core.runtime.simulation import simulate
from kvspec_core.runtime.trace import make_trace


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a request trace through a model's planned KV cache",
        description="Plan MODEL within --memory, then replay the benchmark request trace "
        "through the runtime allocator: prefix-hit rate, peak usage, admissions that waited.",
    )
    add_model_arguments(parser, kv_dtype_help="KV-cache dtype (default auto: the model's dtype)")
    parser.add_argument("--seed", type=seed, default=0, metavar="S", help="trace seed (0)")
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=2000,
        metavar="N",
        help="requests in the trace (default 2000)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def _progress(
    total: int | None, enabled: bool
) -> tuple[Callable[[], None] | None, Callable[[], None]]:
    """(per-event tick, close): tqdm on stderr when installed, else a plain counter."""
    if not enabled:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="event", file=sys.stderr, mininterval=0.5)
        return lambda: bar.update(), bar.close
    state = {"done": 0}
    step = max(1, total // 20) if total else 10_000
    of_total = f"/{total}" if total else ""

    def tick() -> None:
        state["done"] += 1
        if state["done"] % step == 0 or state["done"] == total:
            print(f"\rreplaying: {state['done']}{of_total} events", end="", file=sys.stderr)

    return tick, lambda: print(file=sys.stderr)


def run(args: argparse.Namespace, manager: PluginManager) -> int:
    budget = parse_size(args.memory)
    resolved = resolve_model(args.model)
    options = plan_options(args, args.kv_cache_dtype)
    prepared = prepare_model(
        resolved.config,
        options,
        manager,
        name=resolved.name,
        max_model_len=args.max_model_len,
        max_in_flight_tokens=args.max_in_flight_tokens,
    )
    planned = prepared.plan(budget, manager)
    allocator = KVCacheAllocator.from_plan(planned.plan, manager)
    # Streamed, so any --requests fits in memory; the bar counts events as they come.
    events = make_trace(seed=args.seed, num_requests=args.requests)
    tick, close = _progress(None, not args.no_progress)
    start = time.perf_counter()
    try:
        report = simulate(
            allocator,
            events,
            num_encoder_tokens=planned.context.max_encoder_tokens,
            on_event=tick,
        )
    finally:
        close()
    elapsed = time.perf_counter() - start
    document = {
        "model": resolved.name,
        "kv_budget_bytes": budget,
        "max_model_len": planned.context.max_model_len,
        "block_size": args.block_size,
        "seed": args.seed,
        "groups": [group.kind for group in planned.plan.groups],
        "num_blocks": planned.plan.num_blocks,
        **report.to_dict(),
        "seconds": elapsed,
    }
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    rows = [
        ("model", document["model"]),
        ("KV budget", format_size(budget)),
        ("groups", ", ".join(document["groups"])),
        ("blocks (all pools)", f"{document['num_blocks']:,}"),
        (
            "requests",
            f"{report.requests:,} ({report.admitted:,} admitted, "
            f"{report.never_admitted:,} never admitted, {report.rejected:,} over "
            "max_model_len)",
        ),
        ("events replayed", f"{report.events:,} in {elapsed:.2f} s"),
        (
            "prefix-hit rate",
            f"{report.prefix_hit_rate:.1%} ({report.hit_tokens:,} of "
            f"{report.prompt_tokens:,} prompt tokens)",
        ),
        (
            "peak usage",
            f"{report.peak_usage:.1%} ({report.peak_used_blocks:,} of "
            f"{report.usable_blocks:,} blocks)",
        ),
        (
            "admissions that waited",
            f"{report.waited_admissions:,} ({report.wait_retries:,} retries)",
        ),
        ("preemptions", f"{report.preemptions:,}"),
    ]
    print(render_table(("figure", "value"), rows))
    return 0
