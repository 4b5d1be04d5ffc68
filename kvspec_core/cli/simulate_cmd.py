"""``kvspec simulate MODEL --memory SIZE``: replay a request trace through the plan's allocator.

Plans MODEL exactly as ``kvspec plan`` does, builds the runtime allocator from that plan
(admission caps are the planner's own formulas), and replays a request trace through it:
prefix-hit rate, peak block usage, and how many admissions had to wait for blocks. The trace
(``--trace``) is one of the deterministic built-in ones (``shared``:
:mod:`kvspec_core.runtime.trace`; ``chat``: :mod:`kvspec_core.runtime.chat_trace`) or a
Mooncake-format JSONL file (:mod:`kvspec_core.runtime.mooncake_trace`).

Offload tiers (``--host-memory``, ``--disk`` / ``--disk-size``, as ``kvspec plan`` sizes
them): the allocator gets the plan's tiers (``tiers_from_plan``) and the replay confirms
every transfer at once (no data moves; see :mod:`kvspec_core.runtime.simulation`).
``--offload write-back|write-through`` is the first tier's ``write_policy`` (a block is
copied to it when the device evicts it, the default, or once it is cached); ``--eviction
lru|segmented`` is the eviction order of the device pools and of every tier.
``--plot FILE`` replays again with a host tier of each of :data:`PLOT_HOST_MULTIPLES` times
``--memory`` and draws the prefix-hit rate against host memory.

``--json`` keys: ``model``, ``kv_budget_bytes``, ``max_model_len``, ``block_size``,
``trace``, ``seed`` (null for a file), ``skipped_too_long``, ``eviction``, ``offload``
(``write_back`` / ``write_through``; null without tiers), ``groups`` (kinds),
``num_blocks`` (device, all pools), ``tier_blocks`` (offload tier name -> its blocks, all
pools; empty without tiers), the replay's figures (``events``, ``requests``, ``admitted``,
``never_admitted``, ``readmissions``, ``prompt_tokens``, ``hit_tokens``,
``prefix_hit_rate``, ``waited_admissions``, ``wait_retries``, ``rejected``,
``preemptions``, ``checkpoint_splits``, ``truncated``, ``peak_used_blocks``,
``usable_blocks``, ``peak_usage``), ``hit_tokens_by_tier`` (tier name -> hit tokens served
from it, the device first; they add up to ``hit_tokens``), ``tiers`` (one object per tier,
the device first: ``name``, ``hit_tokens``, ``load_waits`` (admissions whose forward waited
for a load from it), ``loaded_blocks`` / ``loaded_bytes`` (copied to the device),
``stored_blocks`` / ``stored_bytes`` (copied into it), ``demoted_blocks`` /
``demoted_bytes`` (copied from it to the next tier down); bytes are blocks x the pool's
block bytes), ``seconds`` (the replay's wall time); with ``--plot``, ``plot`` (the file) and
``host_memory_sweep`` (per replay: ``host_memory_bytes``, ``host_blocks``, ``hit_tokens``,
``prefix_hit_rate``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import (
    add_model_arguments,
    add_tier_arguments,
    offload_tier_error,
    offload_tier_options,
    plan_options,
    plot_file,
    positive_int,
    seed,
)
from kvspec_core.cli.sizes import parse_size
from kvspec_core.cli.table import render_table
from kvspec_core.errors import ConfigError, KVSpecError
from kvspec_core.models.catalog import resolve_model
from kvspec_core.models.planning import ModelPlan, PreparedModel, prepare_model
from kvspec_core.planner.tiers import OffloadTierError
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import chat_trace, trace
from kvspec_core.runtime.allocator import KVCacheAllocator
from kvspec_core.runtime.mooncake_trace import (
    DEFAULT_OUTPUT_CAP,
    MooncakeRequest,
    count_events,
    read_mooncake_trace,
    trace_events,
)
from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES
from kvspec_core.runtime.simulation import SimulationReport, simulate
from kvspec_core.runtime.tiers import WRITE_BACK, WRITE_THROUGH, tiers_from_plan

#: ``--offload`` choices -> ``OffloadTier.write_policy`` of the first tier.
OFFLOAD_POLICIES = {"write-back": WRITE_BACK, "write-through": WRITE_THROUGH}

#: ``--trace`` names of the built-in generated traces -> (generator, default requests).
BUILT_IN_TRACES: dict[str, tuple[Callable[..., Iterator[tuple]], int]] = {
    "shared": (trace.make_trace, 2000),
    "chat": (chat_trace.make_trace, 3000),
}


class TraceOptionError(KVSpecError, ValueError):
    """``--trace`` and the options around it do not fit together."""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a request trace through a model's planned KV cache",
        description="Plan MODEL within --memory, then replay a request trace (a built-in "
        "one or a Mooncake-format JSONL file) through the runtime allocator: prefix-hit rate, "
        "peak usage, admissions that waited. A prompt is prefilled in one step, so a request "
        "the plan cannot admit at once (longer than max_model_len, or, with sliding-window or "
        "chunked layers, than --max-in-flight-tokens) is counted as over the admission cap.",
    )
    add_model_arguments(parser, kv_dtype_help="KV-cache dtype (default auto: the model's dtype)")
    parser.add_argument(
        "--trace",
        default="shared",
        metavar="shared|chat|FILE",
        help="the request trace: 'shared' (default; 2,000 requests over a few shared system "
        "prompts), 'chat' (3,000 multi-turn chat requests), or a Mooncake-format JSONL file "
        "(one request per line: timestamp, input_length, output_length, hash_ids of 512-token "
        "blocks; replayed in timestamp order, 32 running at once, at most "
        f"{DEFAULT_OUTPUT_CAP} output tokens each). A file's prompts longer than "
        "max_model_len are refused before anything runs, naming the --max-model-len that "
        "fits; --skip-too-long leaves them out instead and shows how many",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        default=None,
        metavar="S",
        help="seed of a built-in trace (default 0; a trace file has none)",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        metavar="N",
        help="take the first N requests (default: 2000 shared, 3000 chat, a file's all)",
    )
    parser.add_argument(
        "--skip-too-long",
        action="store_true",
        help="leave out a trace file's requests whose prompt is longer than max_model_len "
        "(counted in the output) instead of refusing the file",
    )
    add_tier_arguments(parser)
    parser.add_argument(
        "--offload",
        choices=sorted(OFFLOAD_POLICIES),
        default=None,
        help="when a device block is copied to the first offload tier: when the device "
        "evicts it (write-back, the default) or once it is cached (write-through: its "
        "eviction then copies nothing); needs --host-memory or --disk",
    )
    parser.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default=DEFAULT_EVICTION,
        help=f"eviction order of the device pools and of each offload tier (default "
        f"{DEFAULT_EVICTION}; segmented: reused prefixes outlive one-off blocks)",
    )
    parser.add_argument(
        "--plot",
        type=plot_file,
        metavar="FILE",
        help="also replay with a host tier of 0, 1/4, 1/2, 1, 2 and 4 x --memory (the disk "
        "tier as given) and write a PNG of the prefix-hit rate against host memory (needs "
        "kvspec-core[plot])",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (by default one on stderr, never in --json's output: tqdm's with "
        "kvspec-core[progress] installed, else a plain counter)",
    )
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


def _read_trace_file(args: argparse.Namespace) -> list[MooncakeRequest] | None:
    """The requests of ``--trace FILE`` (``None`` for a built-in trace); options that only
    fit the other kind of trace are refused."""
    if args.trace in BUILT_IN_TRACES:
        if Path(args.trace).exists():
            raise TraceOptionError(
                f"--trace {args.trace} names the built-in {args.trace!r} trace, and a file "
                f"{args.trace!r} exists here too: write ./{args.trace} for the file"
            )
        if args.skip_too_long:
            raise TraceOptionError(
                "--skip-too-long applies to a trace file; a built-in trace's requests over "
                "max_model_len are replayed and counted as 'over max_model_len'"
            )
        return None
    if args.seed is not None:
        raise TraceOptionError(
            f"--seed applies to the built-in traces (shared, chat); the trace file "
            f"{args.trace!r} is replayed as written: drop --seed"
        )
    return read_mooncake_trace(args.trace, args.requests)


def _fitting_requests(
    args: argparse.Namespace, requests: list[MooncakeRequest], max_model_len: int
) -> list[MooncakeRequest]:
    """``requests`` whose prompts fit ``max_model_len``: those that do not are refused, or
    left out with ``--skip-too-long``."""
    too_long = [request for request in requests if request.input_length > max_model_len]
    if not too_long:
        return requests
    if not args.skip_too_long:
        longest = max(too_long, key=lambda request: request.input_length)
        fits = max(
            request.input_length + request.decode_tokens(DEFAULT_OUTPUT_CAP) for request in requests
        )
        raise TraceOptionError(
            f"trace {args.trace!r}: {len(too_long):,} of the {len(requests):,} requests taken "
            f"have prompts longer than max_model_len={max_model_len:,} and could never run "
            f"(the longest: line {longest.line}, {longest.input_length:,} tokens). Give "
            f"--max-model-len {fits} (every request then also decodes its output), take fewer "
            "with --requests, or leave them out with --skip-too-long"
        )
    kept = [request for request in requests if request.input_length <= max_model_len]
    if not kept:
        raise TraceOptionError(
            f"trace {args.trace!r}: all {len(requests):,} requests taken have prompts longer "
            f"than max_model_len={max_model_len:,}; nothing is left to replay: give a larger "
            "--max-model-len"
        )
    return kept


#: ``--plot``: host memory of each replay, as multiples of the device KV budget (--memory).
PLOT_HOST_MULTIPLES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


@attrs.frozen
class _Replay:
    """One replay's plan, figures and wall time."""

    planned: ModelPlan
    report: SimulationReport
    seconds: float


def _replay(
    prepared: PreparedModel,
    budget: int,
    manager: PluginManager,
    events: Iterable[tuple],
    total_events: int | None,
    args: argparse.Namespace,
) -> _Replay:
    """Plan ``prepared`` within ``budget`` (its tiers too), build the allocator with the
    plan's offload tiers (the device and each tier evicting in ``--eviction`` order, the
    first tier's write policy ``--offload``) and replay ``events`` through it."""
    eviction = args.eviction
    write_policy = OFFLOAD_POLICIES[args.offload or "write-back"]
    try:
        planned = prepared.plan(budget, manager)
    except OffloadTierError as error:
        raise offload_tier_error(error) from None
    plan = planned.plan
    allocator = KVCacheAllocator.from_plan(
        plan,
        manager,
        eviction=eviction,
        offload_tiers=tiers_from_plan(plan, eviction, write_policy),
    )
    tick, close = _progress(total_events, not args.no_progress)
    start = time.perf_counter()
    try:
        report = simulate(
            allocator,
            events,
            num_encoder_tokens=planned.context.max_encoder_tokens,
            on_event=tick,
            block_bytes=[pool.block_bytes for pool in plan.pools],
        )
    finally:
        close()
    return _Replay(planned, report, time.perf_counter() - start)


def _tier_rows(replay: _Replay) -> list[list[str]]:
    """The per-tier table: blocks, hit tokens, what moved, load waits."""
    plan = replay.planned.plan
    blocks = [sum(pool.num_blocks for pool in plan.pools)] + [
        sum(tier.blocks_per_pool) for tier in plan.tiers
    ]
    hits = replay.report.hit_tokens or 1
    return [
        [
            tier.name,
            f"{count:,}",
            f"{tier.hit_tokens:,} ({tier.hit_tokens / hits:.1%})",
            f"{tier.loaded_blocks:,} ({format_size(tier.loaded_bytes)})",
            f"{tier.stored_blocks:,} ({format_size(tier.stored_bytes)})",
            f"{tier.demoted_blocks:,} ({format_size(tier.demoted_bytes)})",
            f"{tier.load_waits:,}",
        ]
        for tier, count in zip(replay.report.tiers, blocks, strict=True)
    ]


def _tier_table(replay: _Replay) -> str:
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
        _tier_rows(replay),
        align_right=(1, 2, 3, 4, 5, 6),
    )


def _host_sweep(
    args: argparse.Namespace,
    prepared: PreparedModel,
    budget: int,
    manager: PluginManager,
    make_events: Callable[[], Iterable[tuple]],
    total_events: int | None,
) -> list[dict[str, Any]]:
    """``--plot``'s replays: one per :data:`PLOT_HOST_MULTIPLES` of the device budget as
    the host tier (the disk tier, if any, as given)."""
    points = []
    for multiple in PLOT_HOST_MULTIPLES:
        host_bytes = int(budget * multiple)
        sized = attrs.evolve(prepared, host_offload_bytes=host_bytes or None)
        replay = _replay(sized, budget, manager, make_events(), total_events, args)
        points.append(
            {
                "host_memory_bytes": host_bytes,
                "host_blocks": sum(
                    sum(tier.blocks_per_pool)
                    for tier in replay.planned.plan.tiers
                    if tier.name == "host"
                ),
                "hit_tokens": replay.report.hit_tokens,
                "prefix_hit_rate": replay.report.prefix_hit_rate,
            }
        )
    return points


def run(args: argparse.Namespace, manager: PluginManager) -> int:
    budget = parse_size(args.memory)
    tier_options = offload_tier_options(args, "kvspec simulate")
    if args.offload is not None and args.host_memory is None and args.disk is None:
        raise ConfigError(
            f"--offload {args.offload} is the first offload tier's write policy: give "
            "--host-memory SIZE (or --disk PATH --disk-size SIZE) for a tier, or drop --offload"
        )
    if args.plot is not None:
        from kvspec_core.cli.plot import load_pyplot

        load_pyplot()  # fail before replaying when matplotlib is missing
    file_requests = _read_trace_file(args)
    resolved = resolve_model(args.model)
    options = plan_options(args, args.kv_cache_dtype)
    prepared = prepare_model(
        resolved.config,
        options,
        manager,
        name=resolved.name,
        max_model_len=args.max_model_len,
        max_in_flight_tokens=args.max_in_flight_tokens,
        **tier_options,
    )
    make_events: Callable[[], Iterable[tuple]]
    if file_requests is None:
        make_trace, default_requests = BUILT_IN_TRACES[args.trace]
        trace_seed = 0 if args.seed is None else args.seed
        num_requests = args.requests or default_requests
        # Streamed, so any --requests fits in memory; the bar counts events as they come.
        make_events = lambda: make_trace(seed=trace_seed, num_requests=num_requests)  # noqa: E731
        total_events = None
        skipped = 0
        trace_label = f"{args.trace} (seed {trace_seed})"
    else:
        max_model_len = prepared.context.max_model_len
        kept = _fitting_requests(args, file_requests, max_model_len)
        make_events = lambda: trace_events(kept)  # noqa: E731
        total_events = count_events(kept)
        trace_seed = None
        skipped = len(file_requests) - len(kept)
        trace_label = f"{args.trace} (Mooncake format)" + (
            f", {skipped:,} left out: prompt over max_model_len" if skipped else ""
        )
    replay = _replay(prepared, budget, manager, make_events(), total_events, args)
    planned, report, elapsed = replay.planned, replay.report, replay.seconds
    sweep = None
    if args.plot is not None:
        from kvspec_core.cli.plot import plot_hit_rate_vs_host_memory

        sweep = _host_sweep(args, prepared, budget, manager, make_events, total_events)
        plot_hit_rate_vs_host_memory(
            [(point["host_memory_bytes"], point["prefix_hit_rate"]) for point in sweep],
            args.plot,
            # The file's name only: a long path would run off the chart.
            title=f"{resolved.name}, {format_size(budget)} device KV budget, trace "
            f"{Path(args.trace).name}",
            device_bytes=budget,
        )
    document = {
        "model": resolved.name,
        "kv_budget_bytes": budget,
        "max_model_len": planned.context.max_model_len,
        "block_size": args.block_size,
        "trace": args.trace,
        "seed": trace_seed,
        "skipped_too_long": skipped,
        "eviction": args.eviction,
        "offload": OFFLOAD_POLICIES[args.offload or "write-back"] if planned.plan.tiers else None,
        "groups": [group.kind for group in planned.plan.groups],
        "num_blocks": planned.plan.num_blocks,
        "tier_blocks": {tier.name: sum(tier.blocks_per_pool) for tier in planned.plan.tiers},
        **report.to_dict(),
        "seconds": elapsed,
    }
    if sweep is not None:
        document["plot"] = args.plot
        document["host_memory_sweep"] = sweep
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    rows = [
        ("model", document["model"]),
        ("trace", trace_label),
        ("KV budget", format_size(budget)),
        ("groups", ", ".join(document["groups"])),
        ("blocks (all pools)", f"{document['num_blocks']:,}"),
        (
            "requests",
            f"{report.requests:,} ({report.admitted:,} admitted, "
            f"{report.never_admitted:,} never admitted, {report.rejected:,} over the "
            "admission cap)",
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
    if planned.plan.tiers:
        print()
        print(_tier_table(replay))
    if sweep is not None:
        print()
        print(
            render_table(
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
        )
        print(f"plot: {args.plot}")
    return 0
