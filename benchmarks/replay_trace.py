"""Replay the shared request trace through kvspec's runtime block allocator.

Block size 16, prefix caching on. Default: one full-attention group; ``--hybrid``: a
Gemma-2-like pair of groups (sliding window 4096 and full attention) sharing one pool.
All events are generated before timing starts; the timed replay includes admission hashing.

Per event: admit = find the cached prefix + allocate slots for the whole prompt (a "not
now" queues the request; queued requests retry after the next finish, each failed try
counts as a wait); decode = append the token and allocate one slot; finish = free.
Decode and finish events of a request still waiting in the queue are dropped (counted).

    python benchmarks/replay_trace.py [--hybrid] [--blocks 32768] [--requests 2000]
                                      [--seed 0] [--eviction segmented|lru] [--json] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.trace import make_trace

BLOCK_SIZE = 16
#: Longer than any trace request (prompt <= 6144 + 256 output tokens); Gemma-2's own length.
MAX_MODEL_LEN = 8192


def build_allocator(num_blocks: int, hybrid: bool, eviction: str = "segmented") -> KVCacheAllocator:
    attention = dict(num_kv_heads=8, head_size=256, dtype=torch.bfloat16, block_size=BLOCK_SIZE)
    specs = [FullAttentionSpec(**attention)]
    manager = PluginManager()
    if hybrid:
        from kvspec_sliding_window import plugin as sliding_window_plugin
        from kvspec_sliding_window.specs import SlidingWindowSpec

        manager.register(sliding_window_plugin, "sliding_window")
        specs = [*specs, SlidingWindowSpec(sliding_window=4096, **attention)]
    ctx = SizingContext(max_model_len=MAX_MODEL_LEN)
    return KVCacheAllocator(
        specs, num_blocks, ctx, manager=manager, hash_salt=b"replay", eviction=eviction
    )


def replay(events: list[tuple], allocator: KVCacheAllocator) -> dict[str, float | int]:
    requests: dict[int, Request] = {}
    waiting: collections.OrderedDict[int, Request] = collections.OrderedDict()
    pool = allocator.pools[0]
    no_new_blocks = allocator.no_new_blocks
    allocate_slots = allocator.allocate_slots
    find_cached_prefix = allocator.find_cached_prefix
    hit_tokens = prompt_tokens = peak = waits = dropped = decode_stalls = 0

    def admit(request: Request) -> bool:
        nonlocal hit_tokens, peak
        prefix = find_cached_prefix(request)
        result = allocate_slots(
            request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
        )
        if not result:
            return False
        hit_tokens += prefix.num_tokens
        used = pool.num_used_blocks
        if used > peak:
            peak = used
        requests[request.request_id] = request
        return True

    start = time.perf_counter()
    cpu_start = time.process_time()
    for event in events:
        kind = event[0]
        if kind == "decode":
            request = requests.get(event[1])
            if request is None:
                dropped += 1
                continue
            request.token_ids.append(event[2])
            result = allocate_slots(request, 1)
            if result is not no_new_blocks:
                if not result:
                    decode_stalls += 1
                    continue
                used = pool.num_used_blocks
                if used > peak:
                    peak = used
        elif kind == "admit":
            request = Request(event[1], list(event[2]))
            prompt_tokens += len(request.token_ids)
            if waiting or not admit(request):
                waits += 1
                waiting[request.request_id] = request
        else:
            rid = event[1]
            if rid in waiting:
                del waiting[rid]
                dropped += 1
                continue
            allocator.free(rid)
            del requests[rid]
            while waiting:
                head = next(iter(waiting.values()))
                if not admit(head):
                    waits += 1
                    break
                del waiting[head.request_id]
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return {
        "events": len(events),
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "events_per_s": len(events) / elapsed,
        # Less sensitive than wall time to other processes sharing the cores.
        "events_per_cpu_s": len(events) / cpu,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_hashed_per_s": prompt_tokens / elapsed,
        "hit_tokens": hit_tokens,
        "peak_blocks": peak,
        "waits": waits,
        "dropped_events": dropped,
        "decode_stalls": decode_stalls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hybrid", action="store_true",
                        help="sliding window 4096 + full attention sharing one pool")
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eviction", choices=("segmented", "lru"), default="segmented",
                        help="cached-block eviction order (default: segmented LRU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--profile", action="store_true", help="print a cProfile summary")
    args = parser.parse_args()
    events = list(make_trace(seed=args.seed, num_requests=args.requests))
    allocator = build_allocator(args.blocks, args.hybrid, args.eviction)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        figures = replay(events, allocator)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    else:
        figures = replay(events, allocator)
    figures["mode"] = "hybrid" if args.hybrid else "full_attention"
    figures["blocks"] = args.blocks
    figures["eviction"] = args.eviction
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"{figures['mode']}: {figures['events']} events in {figures['seconds']:.3f} s = "
        f"{figures['events_per_s']:,.0f} events/s ({figures['events_per_cpu_s']:,.0f} per CPU "
        f"second); {figures['prompt_tokens_hashed_per_s']:,.0f} "
        f"prompt tokens hashed/s; hit tokens {figures['hit_tokens']:,}; peak blocks "
        f"{figures['peak_blocks']:,}; waits {figures['waits']}"
    )


if __name__ == "__main__":
    main()
