"""What the host tier's ``hash -> slot`` dict alone costs in the tiered Mooncake replay, against
the single-tier replay's whole CPU time, measured in one process: the floor under issue 20's
CPU-time target for a design with one dict per tier.

A block the device evicts into a host tier of ``--host-blocks`` slots costs that tier's dict
three operations the single tier has no counterpart for: the lookup that finds the tier does
not hold it yet (a miss), the deletion of the tier's own LRU victim, and the insertion of the
new entry. This script replays exactly those operations for ``--stores`` blocks (1,284,626:
``replay_trace.py --trace mooncake --host-blocks 262144``'s device->host figure), in batches of
``--batch`` (the replay's stores per ``take_transfers``, 76 on average), in C loops (``map``
over the dict's methods, ``dict.update``: no Python step per block), keys 32-byte digests as
the allocator's; and the same in a dict of 4,096 entries, which stays in the CPU caches (the
loops' own cost). Then, in the same process, ``replay_trace.replay``'s single-tier run of the
same trace. Printed: both CPU times and their ratio. With the target at 1.5x the single tier,
the tiers' whole bookkeeping may add 0.5x; where the dict work alone is near or above that,
no trimming of the code around it meets the target, only one index shared by the tiers (a
stored block updating its entry in place) would.

    python benchmarks/tier_dict_floor.py [--host-blocks 262144] [--stores 1284626]
        [--batch 76] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections import deque
from itertools import islice
from typing import Any

from replay_trace import build_allocator, load_trace, replay

#: ``replay_trace.py --trace mooncake --blocks 32768 --host-blocks 262144``: blocks stored
#: device -> host and ``take_transfers`` calls that stored some (2026-12-07).
MOONCAKE_STORES = 1_284_626
MOONCAKE_STORES_PER_TAKE = 76
#: A dict small enough to stay in the CPU caches: the same operations without the misses
#: (what the loops cost beyond the dict's memory traffic).
CACHE_RESIDENT = 4096


def dict_work(host_blocks: int, stores: int, batch: int) -> float:
    """CPU seconds of a full host tier's three dict operations for ``stores`` new blocks,
    ``batch`` at a time: held check (a miss), the LRU victim's deletion, the insertion."""
    held = {os.urandom(32): slot for slot in range(1, host_blocks + 1)}
    new = [os.urandom(32) for _ in range(stores)]
    # Entries in insertion order: with no hits, the tier's LRU victims are the oldest.
    order = [*held, *new]
    slots = iter(range(host_blocks + 1, host_blocks + 1 + stores))
    gc.collect()
    start = time.process_time()
    for first in range(0, stores, batch):
        victims = new[first : first + batch]
        if any(map(held.__contains__, victims)):
            raise AssertionError("a fresh digest is held: os.urandom repeated itself")
        deque(map(held.__delitem__, order[first : first + len(victims)]), maxlen=0)
        held.update(zip(victims, islice(slots, len(victims)), strict=True))
    elapsed = time.process_time() - start
    if len(held) != host_blocks:
        raise AssertionError(f"the tier holds {len(held)} entries, not {host_blocks}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-blocks", type=int, default=262_144)
    parser.add_argument("--stores", type=int, default=MOONCAKE_STORES)
    parser.add_argument("--batch", type=int, default=MOONCAKE_STORES_PER_TAKE)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if min(args.host_blocks, args.stores, args.batch, args.repeat) < 1:
        parser.error("--host-blocks, --stores, --batch and --repeat must be >= 1")
    loaded = load_trace("mooncake", None)
    floors: list[float] = []
    controls: list[float] = []
    singles: list[float] = []
    for _ in range(args.repeat):
        floors.append(dict_work(args.host_blocks, args.stores, args.batch))
        controls.append(dict_work(CACHE_RESIDENT, args.stores, args.batch))
        allocator = build_allocator(32768, max_model_len=loaded.max_model_len)
        gc.collect()
        singles.append(replay(loaded.events, allocator)["cpu_seconds"])
    floor, single = statistics.median(floors), statistics.median(singles)
    figures: dict[str, Any] = {
        "host_blocks": args.host_blocks,
        "stores": args.stores,
        "batch": args.batch,
        "dict_work_cpu_seconds": floors,
        "cache_resident_dict_work_cpu_seconds": controls,
        "single_tier_cpu_seconds": singles,
        "dict_work_over_single_tier": floor / single,
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"{args.stores:,} stores into a {args.host_blocks:,}-entry host dict ({args.batch} per "
        f"batch): {floor:.2f} CPU s (median of {args.repeat}; "
        f"{', '.join(f'{value:.2f}' for value in floors)}; in a {CACHE_RESIDENT:,}-entry dict "
        f"{statistics.median(controls):.2f}); single-tier Mooncake replay "
        f"{single:.2f} CPU s ({', '.join(f'{value:.2f}' for value in singles)}): the dict "
        f"work alone is {floor / single:.2f}x the single tier (the 1.5x target leaves 0.5x)"
    )


if __name__ == "__main__":
    main()
