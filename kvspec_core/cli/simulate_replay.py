"""``kvspec simulate``'s replays: the plan's allocator (with its offload tiers) built and a
trace's events replayed through it, with a progress bar on stderr; ``--plot``'s sweep of
host-tier sizes."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.arguments import offload_tier_error
from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.planning import ModelPlan, PreparedModel
from kvspec_core.planner.tiers import OffloadTierError
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime.allocator import KVCacheAllocator
from kvspec_core.runtime.simulation import SimulationReport, simulate
from kvspec_core.runtime.tiers import WRITE_BACK, WRITE_THROUGH, tiers_from_plan

#: ``--offload`` choices -> ``OffloadTier.write_policy`` of the first tier.
OFFLOAD_POLICIES = {"write-back": WRITE_BACK, "write-through": WRITE_THROUGH}

#: ``--plot``: host memory of each replay, as multiples of the device KV budget (--memory).
PLOT_HOST_MULTIPLES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


def write_policy(args: argparse.Namespace) -> str:
    """The first offload tier's write policy: ``--offload``, write-back by default."""
    return OFFLOAD_POLICIES[args.offload or "write-back"]


@attrs.frozen
class Replay:
    """One replay's plan, figures and wall time."""

    planned: ModelPlan
    report: SimulationReport
    seconds: float


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


def replay(
    prepared: PreparedModel,
    budget: int,
    manager: PluginManager,
    events: Iterable[tuple],
    total_events: int | None,
    args: argparse.Namespace,
) -> Replay:
    """Plan ``prepared`` within ``budget`` (its tiers too), build the allocator with the
    plan's offload tiers (the device and each tier evicting in ``--eviction`` order, the
    first tier's write policy ``--offload``) and replay ``events`` through it."""
    eviction = args.eviction
    try:
        planned = prepared.plan(budget, manager)
    except OffloadTierError as error:
        raise offload_tier_error(error) from None
    except CapacityError as error:
        # As kvspec plan words it: the exact option to pass.
        largest = prepared.largest_fitting_max_model_len(budget, manager)
        if largest:
            raise CapacityError(f"{error} (pass --max-model-len {largest})") from None
        raise
    plan = planned.plan
    allocator = KVCacheAllocator.from_plan(
        plan,
        manager,
        eviction=eviction,
        offload_tiers=tiers_from_plan(plan, eviction, write_policy(args)),
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
    return Replay(planned, report, time.perf_counter() - start)


def check_host_sweep(prepared: PreparedModel, budget: int, manager: PluginManager) -> None:
    """Plan each of ``--plot``'s host tiers before any replay: a budget whose smallest one
    holds no block of every pool is refused naming --plot (not --host-memory, which the
    sweep replaces)."""
    for multiple in PLOT_HOST_MULTIPLES:
        if not multiple:
            continue
        try:
            attrs.evolve(prepared, host_offload_bytes=int(budget * multiple)).plan(budget, manager)
        except OffloadTierError as error:
            if error.tier != "host":
                raise offload_tier_error(error) from None
            raise ConfigError(
                f"--plot replays host tiers of {', '.join(map(str, PLOT_HOST_MULTIPLES[1:]))} "
                f"times --memory, and at --memory {format_size(budget)} the {multiple}x one "
                f"({format_size(int(budget * multiple))}) cannot hold a block of every pool "
                f"({format_size(error.needed)} needed): pass --memory "
                f"{math.ceil(error.needed / multiple)} or more, or drop --plot"
            ) from None


def host_sweep(
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
        swept = replay(sized, budget, manager, make_events(), total_events, args)
        points.append(
            {
                "host_memory_bytes": host_bytes,
                "host_blocks": sum(
                    sum(tier.blocks_per_pool)
                    for tier in swept.planned.plan.tiers
                    if tier.name == "host"
                ),
                "hit_tokens": swept.report.hit_tokens,
                "prefix_hit_rate": swept.report.prefix_hit_rate,
            }
        )
    return points
