"""A trace through an allocator with offload tiers, with a shadow of what every device block
and tier slot holds: after each admission's transfers ran, every block of its hit must hold
the content of the request's own prefix. The end-to-end check of the tier bookkeeping at a
real trace's scale (the random machines of ``tests/runtime/test_tier_content_machine.py``
check the same on small pools).

The replay is ``replay_trace.py``'s (``replay``, unbatched), with the same model and tiers,
but for two engine steps the replay need not model: each prefill step's transfers are taken
and confirmed before its forward (the replay takes an admission's once, after all its steps:
without forwards to order, the hits are the same, but for write-through copies, which then
move by a step), and a decode that finds no block aborts its request (``aborted_requests``;
the replay counts a stall and goes on). The engine's
part is simulated as in the content machines, with a tag standing for the bytes: a forward
over tokens ``[start, end)`` writes into each block it computes ``(group, tokens covered)``
(a Mamba group only the state block where the step ends), a transfer copies its sources'
tags to its destinations, in the order ``take_transfers()`` gave, before the forward of the
step. ``tokens covered`` is a chained hash of the 16-token blocks and the tail, so a tag is
small whatever the prompt's length.

Checked after each admission: for each group, each block of the hit in the request's table
(a sliding window's kept blocks, a Mamba group's state block at the hit) holds exactly the
prefix it stands for, and no block the next token reads is missing (full attention: every
block of the hit; a sliding window: those of its last ``window - 1`` tokens; Mamba: the
state block). A mismatch is a false hit (a stale slot, a wrong copy, a hit no step
computed, a hole in the hit); ``mismatches`` must be 0. What it cannot see: a forward's tag
stands for the tokens it computed, not for what it read, so a corrupted block the forward
read (a Mamba start state, a window block) shows only if that very block is hit later. ::

    python benchmarks/tier_content_check.py --trace mooncake --host-blocks 262144
        [--disk-blocks N] [--hybrid | --mamba] [--write-through] [--family-keep]
        [--blocks 32768] [--requests N] [--eviction lru|segmented] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from replay_trace import (  # build_allocator: what its callers build allocators with
    BLOCK_SIZE,
    allocator_of_args,
    build_allocator,  # noqa: F401
    load_trace,
    model_name,
    prefill_steps,
    prefix_chain,
)

from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES
from kvspec_core.runtime.tiers import (
    Transfer,
)

#: The group kinds whose hit blocks the check knows (``Shadow._read``).
KNOWN_KINDS = ("full_attention", "sliding_window", "mamba")
#: Mismatches printed in full.
SHOWN_MISMATCHES = 5
#: A tag: (group, tokens covered, chained hash of their whole blocks, the tail's tokens).
Tag = tuple[int, int, int, tuple[int, ...]]


class Shadow:
    """What each device block and tier slot holds (``(tier, pool, block) -> tag``)."""

    def __init__(self, allocator: KVCacheAllocator) -> None:
        if any(tokens != BLOCK_SIZE for tokens in allocator._block_tokens):
            raise ValueError(f"every group's block must be {BLOCK_SIZE} tokens")
        self.allocator = allocator
        self.pool_of = allocator._pool_of
        kinds = [spec.kind for spec in allocator.specs]
        unknown = set(kinds) - set(KNOWN_KINDS)
        if unknown:
            raise ValueError(
                f"groups of kind {sorted(unknown)}: the check knows which blocks a hit of "
                f"{', '.join(KNOWN_KINDS)} groups holds, not theirs"
            )
        self.is_state = [kind == "mamba" for kind in kinds]
        self.windows = [getattr(spec, "sliding_window", None) for spec in allocator.specs]
        self.content: dict[tuple[int, int, int], object] = {}
        # Per request, the chained hash of each whole block of its tokens so far.
        self.chains: dict[str | int, list[int]] = {}
        self.blocks_checked = 0
        self.mismatches = 0
        self.shown: list[dict[str, Any]] = []

    def _tag(self, gid: int, request: Request, end: int) -> Tag:
        tokens = request.token_ids
        chain = prefix_chain(self.chains.setdefault(request.request_id, []), tokens, end)
        whole = end // BLOCK_SIZE
        return (gid, end, chain[whole - 1] if whole else 0, tuple(tokens[whole * BLOCK_SIZE : end]))

    def forward(self, request: Request, start: int, end: int) -> None:
        """The forward over ``[start, end)`` of ``request``: what it writes."""
        tables = self.allocator.block_ids(request.request_id)
        for gid, table in enumerate(tables):
            pool = self.pool_of[gid]
            if self.is_state[gid]:
                index = (end - 1) // BLOCK_SIZE
                if end > start and index < len(table) and table[index]:
                    self.content[(0, pool, table[index])] = self._tag(gid, request, end)
                continue
            last = min(len(table), (end + BLOCK_SIZE - 1) // BLOCK_SIZE)
            for index in range(start // BLOCK_SIZE, last):
                if table[index]:
                    covered = min((index + 1) * BLOCK_SIZE, end)
                    self.content[(0, pool, table[index])] = self._tag(gid, request, covered)

    def copy(self, transfers: Sequence[Transfer]) -> None:
        """The transfers run in order: each destination gets its source's tag."""
        content = self.content
        for transfer in transfers:
            for source, destination in zip(
                transfer.source_blocks, transfer.destination_blocks, strict=True
            ):
                content[(transfer.destination_tier, transfer.pool, destination)] = content.get(
                    (transfer.source_tier, transfer.pool, source), "never written"
                )

    def check(self, request: Request, hit: int) -> None:
        """Each block of ``request``'s hit of ``hit`` tokens holds its prefix, and none the
        next token reads is missing (:meth:`_read`)."""
        if hit == 0:
            return
        for gid, table in enumerate(self.allocator.block_ids(request.request_id)):
            pool = self.pool_of[gid]
            read = self._read(gid, hit)
            checked = read if self.is_state[gid] else range(hit // BLOCK_SIZE)
            for index in checked:
                block = table[index] if index < len(table) else 0
                if not block:
                    if index in read:
                        self._mismatch(request, gid, index, block, "a block", "none")
                    continue
                end = hit if self.is_state[gid] else (index + 1) * BLOCK_SIZE
                expected = self._tag(gid, request, end)
                found = self.content.get((0, pool, block), "never written")
                self.blocks_checked += 1
                if found != expected:
                    self._mismatch(request, gid, index, block, expected, found)

    def _read(self, gid: int, hit: int) -> range:
        """The table positions the token after a hit of ``hit`` tokens reads: a state
        group's block at the hit, a sliding window's last ``window - 1`` tokens, every
        block of full attention."""
        if self.is_state[gid]:
            return range((hit - 1) // BLOCK_SIZE, (hit - 1) // BLOCK_SIZE + 1)
        window = self.windows[gid]
        first = 0 if window is None else max(0, hit - window + 1) // BLOCK_SIZE
        return range(first, hit // BLOCK_SIZE)

    def _mismatch(
        self, request: Request, gid: int, index: int, block: int, expected: object, found: object
    ) -> None:
        self.mismatches += 1
        if len(self.shown) < SHOWN_MISMATCHES:
            self.shown.append(
                {
                    "request": request.request_id,
                    "group": gid,
                    "index": index,
                    "block": block,
                    "expected": repr(expected)[:120],
                    "found": repr(found)[:120],
                }
            )

    def forget(self, request_id: str | int) -> None:
        self.chains.pop(request_id, None)


def check_replay(
    events: list[tuple], allocator: KVCacheAllocator, prefill_chunk: int | None = None
) -> dict[str, Any]:
    """Replay ``events`` as ``replay_trace.replay`` does (unbatched), with the shadow."""
    shadow = Shadow(allocator)
    requests: dict[str | int, Request] = {}
    waiting: collections.OrderedDict[str | int, Request] = collections.OrderedDict()
    moved: collections.Counter[str] = collections.Counter()
    names = allocator.tier_names
    no_new_blocks = allocator.no_new_blocks
    hit_tokens = 0

    def run_transfers() -> None:
        transfers = allocator.take_transfers()
        if transfers:
            shadow.copy(transfers)
            for transfer in transfers:
                moved[f"{names[transfer.source_tier]}->{names[transfer.destination_tier]}"] += (
                    transfer.num_blocks
                )
            allocator.complete_transfers([transfer.transfer_id for transfer in transfers], True)

    def admit(request: Request) -> bool:
        nonlocal hit_tokens, admitted
        prefix = allocator.find_cached_prefix(request)
        start = prefix.num_tokens
        steps = prefill_steps(start, len(request.token_ids), prefix.checkpoint_at, prefill_chunk)
        if not allocator.allocate_slots(request, steps[0], prefix=prefix):
            return False
        # Each step's transfers before its forward, as an engine must run them (an evicted
        # block's store reads it before the forward writes it again).
        run_transfers()
        shadow.check(request, prefix.num_tokens)
        shadow.forward(request, start, start + steps[0])
        start += steps[0]
        for step in steps[1:]:
            if not allocator.allocate_slots(request, step):
                run_transfers()
                allocator.free(request.request_id)
                shadow.forget(request.request_id)
                return False
            run_transfers()
            shadow.forward(request, start, start + step)
            start += step
        admitted += 1
        hit_tokens += prefix.num_tokens
        requests[request.request_id] = request
        return True

    def admit_waiting() -> None:
        while waiting:
            head = next(iter(waiting.values()))
            if not admit(head):
                break
            del waiting[head.request_id]

    aborted = admitted = 0
    started = time.process_time()
    for event in events:
        kind = event[0]
        if kind == "decode":
            request = requests.get(event[1])
            if request is None:
                continue
            request.token_ids.append(event[2])
            result = allocator.allocate_slots(request, 1)
            if not result:
                # No block for it: the engine aborts the request (its later events are
                # dropped), which frees blocks for the queue.
                aborted += 1
                allocator.free(request.request_id)
                del requests[request.request_id]
                shadow.forget(request.request_id)
                admit_waiting()
                continue
            if result is not no_new_blocks:
                run_transfers()  # the new block may have evicted a cached one
            end = len(request.token_ids)
            shadow.forward(request, end - 1, end)
        elif kind == "admit":
            request = Request(event[1], list(event[2]))
            if waiting or not admit(request):
                waiting[request.request_id] = request
        else:
            rid = event[1]
            if waiting.pop(rid, None) is None:
                if rid not in requests:
                    continue
                allocator.free(rid)
                del requests[rid]
                shadow.forget(rid)
            # As after any finish, also one of a request still queued (replay_trace.replay).
            admit_waiting()
    return {
        "hit_tokens": hit_tokens,
        "blocks_moved": dict(sorted(moved.items())),
        "admitted_requests": admitted,
        "waiting_at_end": len(waiting),
        "aborted_requests": aborted,
        "blocks_checked": shadow.blocks_checked,
        "mismatches": shadow.mismatches,
        "shown_mismatches": shadow.shown,
        "cpu_seconds": time.process_time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="mooncake", metavar="shared|chat|mooncake[:FILE]")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hybrid", action="store_true", help="sliding window 4096 + full")
    model.add_argument("--mamba", action="store_true", help="Mamba (align) + full")
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--host-blocks", type=int, default=262144)
    parser.add_argument("--disk-blocks", type=int, default=0)
    parser.add_argument("--write-through", action="store_true")
    parser.add_argument("--family-keep", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--eviction", choices=EVICTION_POLICIES, default=DEFAULT_EVICTION)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.blocks < 2 or args.host_blocks < 0 or args.disk_blocks < 0:
        parser.error("--blocks must be >= 2, --host-blocks and --disk-blocks >= 0")
    if (args.disk_blocks or args.write_through or args.family_keep) and not args.host_blocks:
        parser.error(
            "--disk-blocks, --write-through and --family-keep need --host-blocks: the disk "
            "tier sits below the host tier, the policies are the host tier's"
        )
    model = model_name(args)
    try:
        events, requests, _, max_model_len, prefill_chunk = load_trace(
            args.trace, args.requests, args.hybrid
        )
    except ValueError as error:
        parser.error(str(error))
    allocator = allocator_of_args(args, max_model_len, parser)
    figures = check_replay(events, allocator, prefill_chunk)
    header = {
        "trace": args.trace,
        "model": model,
        "requests": requests,
        "blocks": args.blocks,
        "host_blocks": args.host_blocks,
        "disk_blocks": args.disk_blocks,
        "write_through": args.write_through,
        "family_keep": args.family_keep,
        "eviction": args.eviction,
    }
    if args.json:
        print(json.dumps({**header, **figures}))
    else:
        print(
            f"{model} on {args.trace} ({requests:,} requests), {args.blocks:,} device + "
            f"{args.host_blocks:,} host + {args.disk_blocks:,} disk blocks: hit tokens "
            f"{figures['hit_tokens']:,}; blocks moved {figures['blocks_moved']}; hit blocks "
            f"checked {figures['blocks_checked']:,}, mismatches {figures['mismatches']} "
            f"({figures['cpu_seconds']:.1f} CPU s); requests admitted "
            f"{figures['admitted_requests']:,}, aborted for want of a block "
            f"{figures['aborted_requests']}, still waiting {figures['waiting_at_end']}"
        )
        for shown in figures["shown_mismatches"]:
            print(f"  mismatch: {shown}")
    if figures["mismatches"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
