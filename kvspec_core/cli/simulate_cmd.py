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
``--plot FILE`` replays again with a host tier of each of
:data:`~kvspec_core.cli.simulate_replay.PLOT_HOST_MULTIPLES` times ``--memory`` and draws the
prefix-hit rate against host memory.

``--json``: the document of :mod:`kvspec_core.cli.simulate_report`, whose docstring lists
its keys; the human output is rendered from it (:mod:`kvspec_core.cli.simulate_text`).
Choosing the trace and its events: :mod:`kvspec_core.cli.simulate_trace`; the replays and
the progress bar: :mod:`kvspec_core.cli.simulate_replay`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import (
    add_model_arguments,
    add_tier_arguments,
    check_max_model_len,
    check_tp_accepted,
    offload_tier_options,
    plan_options,
    plot_file,
    positive_int,
    seed,
)
from kvspec_core.cli.simulate_replay import (
    OFFLOAD_POLICIES,
    PLOT_HOST_MULTIPLES,
    check_host_sweep,
    host_sweep,
    replay,
)
from kvspec_core.cli.simulate_report import simulate_report
from kvspec_core.cli.simulate_text import render_simulation
from kvspec_core.cli.simulate_trace import (
    BUILT_IN_TRACES,
    TraceOptionError,
    read_trace_file,
    trace_replay,
)
from kvspec_core.cli.sizes import parse_size
from kvspec_core.errors import ConfigError
from kvspec_core.models.catalog import resolve_model
from kvspec_core.models.planning import prepare_model
from kvspec_core.models.trained_length import trained_max_model_len
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime.mooncake_trace import DEFAULT_OUTPUT_CAP
from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES

# The public names this module had before the trace, replay, report and text split stay
# importable from here.
__all__ = [
    "BUILT_IN_TRACES",
    "OFFLOAD_POLICIES",
    "PLOT_HOST_MULTIPLES",
    "TraceOptionError",
    "add_parser",
    "run",
]


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
    file_requests = read_trace_file(args)
    resolved = resolve_model(args.model)
    check_tp_accepted(resolved.config, args.tp)
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
    check_max_model_len(prepared.model, args)
    trained = trained_max_model_len(prepared.model)
    trace = trace_replay(
        args,
        file_requests,
        prepared.context.max_model_len,
        None if trained is None else trained[0],
    )
    if args.plot is not None:
        check_host_sweep(prepared, budget, manager)
    first = replay(prepared, budget, manager, trace.make_events(), trace.total_events, args)
    sweep = None
    if args.plot is not None:
        from kvspec_core.cli.plot import plot_hit_rate_vs_host_memory

        sweep = host_sweep(args, prepared, budget, manager, trace.make_events, trace.total_events)
        plot_hit_rate_vs_host_memory(
            [(point["host_memory_bytes"], point["prefix_hit_rate"]) for point in sweep],
            args.plot,
            # The file's name only: a long path would run off the chart.
            title=f"{resolved.name}, {format_size(budget)} device KV budget, trace "
            f"{Path(args.trace).name}",
            device_bytes=budget,
        )
    document = simulate_report(resolved.name, budget, args, trace, first, sweep)
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(render_simulation(document, trace.label))
    return 0
