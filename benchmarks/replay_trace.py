"""Replay a request trace through kvspec's runtime block allocator.

Traces (``--trace``): ``shared`` (default), the shared-system-prompt request trace
(:mod:`kvspec_core.runtime.trace`, 2,000 requests); ``chat``, the multi-turn chat trace
(:mod:`kvspec_core.runtime.chat_trace`, 3,000 requests). Both are copies of the generators in
``shared/bench/`` (same events for the same seed). ``mooncake[:FILE]``: a Mooncake-format
JSONL trace read by :mod:`kvspec_core.runtime.mooncake_trace` (first 2,000 requests by
default; 32 running, at most 200 output tokens each); FILE defaults to ``$MOONCAKE_TRACE_FILE``,
else ``../shared/bench/mooncake_synthetic_trace.jsonl`` beside the repository (Mooncake's
FAST'25 synthetic trace, ``FAST25-release/traces/synthetic_trace.jsonl``). Its prompts reach
191,378 tokens (191,386 with their output), so the allocator's max_model_len is 262,144 for
it (8,192 otherwise); a request longer than that is refused before the replay (it would
block the admission queue).
``--hybrid`` with it prefills in chunks of 16,384 tokens (``max_in_flight_tokens``: its
sliding-window group admits no more per step); every other replay prefills a prompt in one
step (or two, see ``checkpoint_at`` below).

Offload tiers: ``--host-blocks N`` adds a host tier of N blocks below the device pool,
``--disk-blocks M`` a disk tier below that (each with the ``--eviction`` order). Evicted
cached blocks go down the tiers instead of being lost, and prefixes are found across them.
``--write-through``: the host tier's ``write_policy`` is ``write_through`` (a block is
copied to it once cached, so its eviction copies nothing) instead of ``write_back``.
``--family-keep``: the host tier's ``keep`` is ``family_rules`` (the sliding-window group
of ``--hybrid`` stores only a freed request's last window below the device).
No data moves here: after each admission and each block-taking decode the replay takes the
recorded transfers and confirms them all at once, as an engine would after running them
before its forward. Per-event CPU time includes that bookkeeping.

Block size 16, prefix caching on, all groups sharing one pool. Models: default one
full-attention group; ``--hybrid``: Gemma-2-like, sliding window 4096 + full attention;
``--mamba``: Jamba-like, a Mamba state group (the real ``MambaSpec``, ``align`` prefix
caching) + full attention. All events are generated and the allocator built before timing
starts (then the heap is frozen, as an engine freezes it after start-up); the timed replay
includes admission hashing.

Per event: admit = find the cached prefix + allocate slots for the whole prompt (a "not
now" queues the request; queued requests retry after the next finish, each failed try
counts as a wait); decode = append the token and allocate one slot; finish = free.
Decode and finish events of a request still waiting in the queue are dropped (counted).
``--batched``: each run of consecutive decode events is one engine step, given to one
``decode_step`` call (the step's request ids and sampled tokens, as a model runner reports
them: the allocator appends each token and allocates its slot).
When the allocator names a ``checkpoint_at`` position (Mamba: the prompt shares content
with earlier prompts beyond the last saved state), the prefill is split there so that the
state is saved, as ``kvspec simulate`` does.

Hit tokens are printed against the trace's ideal at 16-token blocks: for each prompt the
longest prefix seen before (in an earlier prompt or an earlier request's prompt + output),
at most prompt length - 1, floored to whole blocks.

    python benchmarks/replay_trace.py [--trace shared|chat|mooncake[:FILE]]
                                      [--hybrid | --mamba] [--blocks 32768] [--requests N]
                                      [--host-blocks N [--disk-blocks N] [--write-through]
                                       [--family-keep]]
                                      [--seed 0] [--eviction POLICY] [--batched] [--json]
                                      [--profile]

``--json`` prints one object: ``trace`` (``shared``, ``chat`` or ``mooncake``),
``trace_file`` (the Mooncake file, else null), ``mode`` (``full_attention``, ``hybrid``,
``mamba_hybrid``), ``blocks``, ``host_blocks`` and ``disk_blocks`` (0: no such tier),
``prefill_chunk`` (null: one step), ``eviction``, ``write_policy`` and ``keep`` (the host
tier's; null without one), ``max_model_len``, ``requests``, ``events``,
``seconds`` and ``cpu_seconds`` (the timed replay), ``events_per_s``, ``events_per_cpu_s``,
``prompt_tokens`` (of every arriving request, those the queue held until the trace finished
them included: their prompts were hashed too), ``prompt_tokens_hashed_per_s``,
``hit_tokens`` (prefix-cache hits over all admissions), ``hit_tokens_by_tier`` (``device``,
``host``, ``disk``: where those hit tokens came from, ``TieredPrefix.tokens_by_tier``; they
add up to ``hit_tokens``), ``blocks_moved`` (``"device->host"``, ``"host->device"``,
``"host->disk"``, ``"disk->device"``: blocks each kind of transfer copied),
``ideal_hit_tokens`` (the trace's ideal reusable prefix at 16-token blocks, as above),
``prefill_steps`` (prefill steps of the admitted requests), ``peak_blocks``, ``waits``
(failed admission tries), ``dropped_events`` (decodes and
finishes of requests still queued) and
``decode_stalls`` (decodes that found no free block).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.errors import KVSpecError
from kvspec_core.runtime import CachedPrefix, KVCacheAllocator, NotNow, Request, chat_trace, trace
from kvspec_core.runtime.mooncake_trace import TraceFormatError, read_mooncake_trace, trace_events
from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES
from kvspec_core.runtime.tiers import (
    KEEP_EVERYTHING,
    KEEP_FAMILY_RULES,
    WRITE_BACK,
    WRITE_THROUGH,
    OffloadTier,
    TieredPrefix,
)

BLOCK_SIZE = 16
#: Longer than any trace request (shared: prompt <= 6144 + 256 output tokens; chat: prompt +
#: output <= 7,500); Gemma-2's own length.
MAX_MODEL_LEN = 8192
#: Model shapes ``--hybrid`` / ``--mamba`` select (default: full attention only).
MODELS = ("full_attention", "hybrid", "mamba_hybrid")
#: ``--trace`` name -> (trace generator, default number of requests).
TRACES = {"shared": (trace.make_trace, 2000), "chat": (chat_trace.make_trace, 3000)}
#: ``--trace mooncake``: its max_model_len (longer than its longest request, 191,386 tokens)
#: and default number of requests.
MOONCAKE_MAX_MODEL_LEN = 262_144
MOONCAKE_REQUESTS = 2000
#: ``--trace mooncake`` without a file: ``$MOONCAKE_TRACE_FILE``, else this one.
MOONCAKE_DEFAULT_FILE = (
    Path(__file__).resolve().parents[2] / "shared" / "bench" / "mooncake_synthetic_trace.jsonl"
)


def build_allocator(
    num_blocks: int,
    model: str | bool = "full_attention",
    eviction: str = DEFAULT_EVICTION,
    max_model_len: int = MAX_MODEL_LEN,
    host_blocks: int = 0,
    disk_blocks: int = 0,
    write_policy: str = WRITE_BACK,
    keep: str = KEEP_EVERYTHING,
) -> KVCacheAllocator:
    """The allocator of one of :data:`MODELS` (``True`` / ``False``: hybrid or not), with a
    host offload tier of ``host_blocks`` (its ``write_policy`` and ``keep`` as given) and a
    disk tier of
    ``disk_blocks`` below it (0: no such tier; each tier's own eviction order is
    ``eviction`` too)."""
    if isinstance(model, bool):
        model = "hybrid" if model else "full_attention"
    attention = dict(num_kv_heads=8, head_size=256, dtype=torch.bfloat16, block_size=BLOCK_SIZE)
    specs = [FullAttentionSpec(**attention)]
    manager = PluginManager()
    mamba_cache_mode = "none"
    if model == "hybrid":
        from kvspec_sliding_window import plugin as sliding_window_plugin
        from kvspec_sliding_window.specs import SlidingWindowSpec

        manager.register(sliding_window_plugin, "sliding_window")
        specs.append(SlidingWindowSpec(sliding_window=4096, **attention))
    elif model == "mamba_hybrid":
        from kvspec_mamba import plugin as mamba_plugin
        from kvspec_mamba.specs import MambaSpec

        manager.register(mamba_plugin, "mamba")
        # Jamba-1.5-Mini's per-layer state: conv (d_inner, d_conv - 1), SSM (d_inner, d_state).
        specs.append(
            MambaSpec(
                block_size=BLOCK_SIZE,
                shapes=((8192, 3), (8192, 16)),
                dtypes=(torch.bfloat16, torch.float32),
                mamba_type="mamba1",
            )
        )
        mamba_cache_mode = "align"
    elif model != "full_attention":
        raise ValueError(f"model={model!r} must be one of {MODELS}")
    ctx = SizingContext(max_model_len=max_model_len, mamba_cache_mode=mamba_cache_mode)
    return KVCacheAllocator(
        specs,
        num_blocks,
        ctx,
        manager=manager,
        hash_salt=b"replay",
        eviction=eviction,
        offload_tiers=offload_tiers(host_blocks, disk_blocks, eviction, write_policy, keep),
    )


def offload_tiers(
    host_blocks: int,
    disk_blocks: int,
    eviction: str,
    write_policy: str = WRITE_BACK,
    keep: str = KEEP_EVERYTHING,
) -> tuple[OffloadTier, ...]:
    """The tiers ``--host-blocks`` / ``--disk-blocks`` ask for (a disk tier sits below the
    host tier, so it needs one; ``write_policy`` and ``keep`` are the host tier's)."""
    if disk_blocks and not host_blocks:
        raise ValueError("a disk tier needs a host tier above it: give host_blocks too")
    tiers = []
    if host_blocks:
        tiers.append(OffloadTier("host", host_blocks, eviction, write_policy, keep))
    if disk_blocks:
        tiers.append(OffloadTier("disk", disk_blocks, eviction))
    return tuple(tiers)


def engine_steps(events: list[tuple]) -> list[tuple]:
    """The events with every run of consecutive decode events (one engine step) merged
    into one ``("step", [request_id, ...], [token, ...])`` event: the step's requests and
    the tokens they sampled, as an engine's model runner reports them."""
    merged: list[tuple] = []
    for event in events:
        if event[0] != "decode":
            merged.append(event)
            continue
        if not merged or merged[-1][0] != "step":
            merged.append(("step", [], []))
        merged[-1][1].append(event[1])
        merged[-1][2].append(event[2])
    return merged


def prefill_steps(
    hit: int, num_tokens: int, checkpoint_at: int | None, prefill_chunk: int | None
) -> list[int]:
    """The tokens of each prefill step of a prompt of ``num_tokens`` past a hit of ``hit``:
    one step, or two split at ``checkpoint_at`` (where the prompt shares content with earlier
    ones, so the state groups save a checkpoint there), each cut into steps of at most
    ``prefill_chunk`` tokens (``None``: uncut)."""
    if checkpoint_at is None:
        steps = [num_tokens - hit]
    else:
        steps = [checkpoint_at - hit, num_tokens - checkpoint_at]
    if prefill_chunk is None:
        return steps
    return [
        min(prefill_chunk, step - start)
        for step in steps
        for start in range(0, step, prefill_chunk)
    ]


def prefix_chain(chain: list[int], tokens: Sequence[int], upto: int) -> list[int]:
    """``chain`` extended in place to one entry per whole :data:`BLOCK_SIZE`-token block of
    ``tokens[:upto]``: each entry Python's hash of the one before and the block's tokens, an
    id of that prefix for the benchmarks' checks (not the allocator's salted hashes)."""
    for block in range(len(chain), upto // BLOCK_SIZE):
        previous = chain[-1] if chain else 0
        chain.append(hash((previous, tuple(tokens[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]))))
    return chain


def model_name(args: argparse.Namespace) -> str:
    """The :data:`MODELS` name ``--hybrid`` / ``--mamba`` select."""
    return "mamba_hybrid" if args.mamba else "hybrid" if args.hybrid else "full_attention"


def replay(
    events: list[tuple],
    allocator: KVCacheAllocator,
    batched: bool = False,
    prefill_chunk: int | None = None,
    prefill_split: Callable[[Request, CachedPrefix, int], list[int]] | None = None,
) -> dict[str, Any]:
    """Replay ``events``; ``batched``: each engine step's decodes through one
    ``decode_step`` call (peak blocks then sampled once per step); ``prefill_chunk``:
    prefill a prompt in steps of at most that many tokens (``None``: one step);
    ``prefill_split``: instead, the tokens of each prefill step of a request admitted with a
    prefix while that many others run (an engine's own chunking, each step's transfers taken
    before the next step; an empty list leaves the request waiting). Otherwise an
    admission's transfers are taken once, after all its steps."""
    num_events = len(events)
    if batched:
        events = engine_steps(events)
    decode_step = allocator.decode_step
    requests: dict[int, Request] = {}
    waiting: collections.OrderedDict[int, Request] = collections.OrderedDict()
    pool = allocator.pools[0]
    no_new_blocks = allocator.no_new_blocks
    allocate_slots = allocator.allocate_slots
    find_cached_prefix = allocator.find_cached_prefix
    hit_tokens = prompt_tokens = peak = waits = dropped = decode_stalls = num_prefill_steps = 0
    tier_names = allocator.tier_names
    tiered = len(tier_names) > 1
    hit_by_tier = [0] * len(tier_names)
    # (source tier, destination tier) -> blocks moved: loads, stores, demotions.
    moved: collections.Counter[tuple[int, int]] = collections.Counter()
    take_transfers = allocator.take_transfers
    complete_transfers = allocator.complete_transfers

    def run_transfers() -> None:
        # No real copies here: every transfer is confirmed as soon as it is recorded (an
        # engine runs them before the step's forward, then confirms them).
        transfers = take_transfers()
        if transfers:
            for transfer in transfers:
                moved[transfer.source_tier, transfer.destination_tier] += transfer.num_blocks
            complete_transfers([transfer.transfer_id for transfer in transfers], True)

    def admit(request: Request) -> bool:
        nonlocal hit_tokens, peak, num_prefill_steps
        prefix = find_cached_prefix(request)
        remaining = len(request.token_ids) - prefix.num_tokens
        split = prefix.checkpoint_at
        if (
            prefill_split is None
            and split is None
            and (prefill_chunk is None or remaining <= prefill_chunk)
        ):
            if not allocate_slots(request, remaining, prefix=prefix):
                return False
            num_prefill_steps += 1
        else:
            # Several prefill steps: the engine's own (prefill_split), or the first ends
            # where the prompt shares content with earlier ones (checkpoint_at), so the
            # state groups save a checkpoint there; with prefill_chunk none is longer.
            if prefill_split is not None:
                steps = prefill_split(request, prefix, len(requests))
            else:
                steps = prefill_steps(
                    prefix.num_tokens, len(request.token_ids), split, prefill_chunk
                )
            if not steps or not allocate_slots(request, steps[0], prefix=prefix):
                return False
            for step in steps[1:]:
                if tiered and prefill_split is not None:
                    run_transfers()  # an engine's step: its copies run before its forward
                if not allocate_slots(request, step):
                    if tiered:
                        run_transfers()  # what the earlier steps recorded, before the free
                    allocator.free(request.request_id)
                    return False
            num_prefill_steps += len(steps)
        hit_tokens += prefix.num_tokens
        if tiered:
            run_transfers()
            if prefix.__class__ is TieredPrefix:
                for tier, tokens in enumerate(prefix.tokens_by_tier):
                    hit_by_tier[tier] += tokens
            else:
                hit_by_tier[0] += prefix.num_tokens
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
                if tiered:
                    run_transfers()  # the new block may have evicted a cached one
                used = pool.num_used_blocks
                if used > peak:
                    peak = used
        elif kind == "step":
            # A decode step: the allocator appends each request's sampled token and gives
            # it its slot. Decodes of requests still queued are dropped first.
            ids, tokens = event[1], event[2]
            if waiting:
                kept = [index for index, rid in enumerate(ids) if rid in requests]
                dropped += len(ids) - len(kept)
                ids = [ids[index] for index in kept]
                tokens = [tokens[index] for index in kept]
            results = decode_step(ids, tokens)
            if results.count(no_new_blocks) != len(results):
                if tiered:
                    run_transfers()
                # A class test, not truth: Allocated.__bool__ is a Python call per result.
                decode_stalls += sum(1 for result in results if result.__class__ is NotNow)
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
                # Finished while queued: dropped. The queue is retried as after any finish
                # (its head may be the one dropped), as kvspec simulate does.
                del waiting[rid]
                dropped += 1
            else:
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
        "events": num_events,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "events_per_s": num_events / elapsed,
        # Less sensitive than wall time to other processes sharing the cores.
        "events_per_cpu_s": num_events / cpu,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_hashed_per_s": prompt_tokens / elapsed,
        "hit_tokens": hit_tokens,
        "hit_tokens_by_tier": (
            dict(zip(tier_names, hit_by_tier, strict=True)) if tiered else {"device": hit_tokens}
        ),
        "blocks_moved": {
            f"{tier_names[source]}->{tier_names[destination]}": count
            for (source, destination), count in sorted(moved.items())
        },
        "prefill_steps": num_prefill_steps,
        "peak_blocks": peak,
        "waits": waits,
        "dropped_events": dropped,
        "decode_stalls": decode_stalls,
    }


def ideal_hit_tokens(events: list[tuple]) -> int:
    """The trace's ideal reusable prefix tokens at :data:`BLOCK_SIZE`-token blocks."""
    stats = chat_trace.trace_stats(events, block_sizes=(BLOCK_SIZE,))
    return int(stats[f"ideal_reusable_at_block_{BLOCK_SIZE}"])


def mooncake_events(path: str, num_requests: int) -> tuple[list[tuple], int]:
    """The events of the first ``num_requests`` requests of a Mooncake trace and how many
    were taken; exits naming the request when a prompt is over
    :data:`MOONCAKE_MAX_MODEL_LEN` (it could never be admitted and would block the queue)."""
    try:
        requests = read_mooncake_trace(path, num_requests)
    except TraceFormatError as error:
        sys.exit(
            f"replay_trace.py: {error} (--trace mooncake:FILE or $MOONCAKE_TRACE_FILE names "
            "another file)"
        )
    longest = max(requests, key=lambda request: request.input_length)
    if longest.input_length > MOONCAKE_MAX_MODEL_LEN:
        sys.exit(
            f"replay_trace.py: {path}, line {longest.line}: a prompt of "
            f"{longest.input_length:,} tokens is over max_model_len={MOONCAKE_MAX_MODEL_LEN:,}; "
            "take fewer requests (--requests) or raise MOONCAKE_MAX_MODEL_LEN"
        )
    return list(trace_events(requests)), len(requests)


class LoadedTrace(NamedTuple):
    """A trace's events and how to replay them."""

    events: list[tuple]
    #: Requests taken from the trace.
    requests: int
    #: The file read (a Mooncake trace), else None.
    trace_file: str | None
    max_model_len: int
    #: Tokens per prefill step (``--hybrid`` on Mooncake), None: a prompt in one step.
    prefill_chunk: int | None


def load_trace(
    trace_name: str, requests: int | None, hybrid: bool = False, seed: int | None = None
) -> LoadedTrace:
    """The trace ``--trace`` names (``shared``, ``chat``, ``mooncake[:FILE]``; a Mooncake
    file defaults to ``$MOONCAKE_TRACE_FILE``, else :data:`MOONCAKE_DEFAULT_FILE`), its
    first ``requests`` requests (None: the trace's default); ``hybrid``: the sliding-window
    model, whose Mooncake prompts are prefilled in chunks. Raises ValueError naming the
    option on a bad name or a seed given to a Mooncake trace."""
    name, _, trace_file = trace_name.partition(":")
    if name == "mooncake":
        if seed is not None:
            raise ValueError("--seed applies to shared and chat; a Mooncake trace has no seed")
        trace_file = trace_file or os.environ.get("MOONCAKE_TRACE_FILE") or ""
        trace_file = trace_file or str(MOONCAKE_DEFAULT_FILE)
        taken = MOONCAKE_REQUESTS if requests is None else requests
        events, taken = mooncake_events(trace_file, taken)
        # Its sliding-window group admits at most max_in_flight_tokens prompt tokens per
        # step: longer prompts are prefilled in chunks of that many.
        chunk = SizingContext(max_model_len=MOONCAKE_MAX_MODEL_LEN).max_in_flight_tokens
        return LoadedTrace(
            events, taken, trace_file, MOONCAKE_MAX_MODEL_LEN, chunk if hybrid else None
        )
    if name in TRACES and not trace_file:
        make_trace, default_requests = TRACES[name]
        taken = default_requests if requests is None else requests
        events = list(make_trace(seed=0 if seed is None else seed, num_requests=taken))
        return LoadedTrace(events, taken, None, MAX_MODEL_LEN, None)
    raise ValueError(f"--trace {trace_name!r}: give shared, chat, mooncake or mooncake:FILE")


def allocator_of_args(
    args: argparse.Namespace, max_model_len: int, parser: argparse.ArgumentParser
) -> KVCacheAllocator:
    """The allocator the command line asks for (model, pools, tiers and their policies);
    pools too small for the model are a usage error naming what the allocator refused."""
    try:
        return build_allocator(
            args.blocks,
            model_name(args),
            args.eviction,
            max_model_len,
            args.host_blocks,
            args.disk_blocks,
            WRITE_THROUGH if args.write_through else WRITE_BACK,
            KEEP_FAMILY_RULES if args.family_keep else KEEP_EVERYTHING,
        )
    except KVSpecError as error:
        parser.error(str(error))


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace",
        default="shared",
        metavar="shared|chat|mooncake[:FILE]",
        help="shared system prompts (default), multi-turn chat, or a Mooncake-format JSONL "
        "trace (default file: $MOONCAKE_TRACE_FILE, else ../shared/bench/"
        "mooncake_synthetic_trace.jsonl beside the repository)",
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--hybrid",
        action="store_true",
        help="sliding window 4096 + full attention sharing one pool",
    )
    model.add_argument(
        "--mamba",
        action="store_true",
        help="Mamba state (align mode) + full attention sharing one pool",
    )
    parser.add_argument("--blocks", type=positive_int, default=32768)
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        metavar="N",
        help="a host offload tier of N blocks below the device pool (default 0: none)",
    )
    parser.add_argument(
        "--disk-blocks",
        type=int,
        default=0,
        metavar="N",
        help="a disk offload tier of N blocks below the host tier (needs --host-blocks)",
    )
    parser.add_argument(
        "--write-through",
        action="store_true",
        help="copy a block to the host tier once it is cached (write-through) instead of "
        "when the device evicts it (write-back, the default); needs --host-blocks",
    )
    parser.add_argument(
        "--family-keep",
        action="store_true",
        help="store below the device only what each group's family rules name (a sliding "
        "window: a freed request's last window) instead of every evicted block; needs "
        "--host-blocks",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="requests in the trace (default: 2000 shared, 3000 chat, 2000 mooncake)",
    )
    parser.add_argument("--seed", type=int, default=None, help="built-in traces' seed (0)")
    parser.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default=DEFAULT_EVICTION,
        help=f"cached-block eviction order (default: {DEFAULT_EVICTION})",
    )
    parser.add_argument(
        "--batched",
        action="store_true",
        help="decode steps through decode_step, one call per engine step",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--profile", action="store_true", help="print a cProfile summary")
    args = parser.parse_args()
    try:
        loaded = load_trace(args.trace, args.requests, args.hybrid, args.seed)
    except ValueError as error:
        parser.error(str(error))
    events, requests, trace_file, max_model_len, prefill_chunk = loaded
    trace_name = args.trace.partition(":")[0]
    if args.disk_blocks and not args.host_blocks:
        parser.error("--disk-blocks needs --host-blocks: the disk tier sits below the host tier")
    if args.host_blocks < 0 or args.disk_blocks < 0:
        parser.error("--host-blocks and --disk-blocks count blocks: give 0 or more")
    if args.write_through and not args.host_blocks:
        parser.error("--write-through is the host tier's write policy: give --host-blocks too")
    if args.family_keep and not args.host_blocks:
        parser.error("--family-keep is the host tier's keep policy: give --host-blocks too")
    write_policy = WRITE_THROUGH if args.write_through else WRITE_BACK
    keep = KEEP_FAMILY_RULES if args.family_keep else KEEP_EVERYTHING
    model = model_name(args)
    allocator = allocator_of_args(args, max_model_len, parser)
    # As an engine freezes its heap once started, the KV-cache allocator built (vLLM's
    # engine core does; vs_vllm.py too).
    gc.collect()
    gc.freeze()
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        figures = replay(events, allocator, args.batched, prefill_chunk)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    else:
        figures = replay(events, allocator, args.batched, prefill_chunk)
    ideal = ideal_hit_tokens(events)
    figures.update(
        mode=model,
        trace=trace_name,
        trace_file=trace_file or None,
        blocks=args.blocks,
        host_blocks=args.host_blocks,
        disk_blocks=args.disk_blocks,
        eviction=args.eviction,
        write_policy=write_policy if args.host_blocks else None,
        keep=keep if args.host_blocks else None,
        max_model_len=max_model_len,
        requests=requests,
        prefill_chunk=prefill_chunk,
        ideal_hit_tokens=ideal,
    )
    if args.json:
        print(json.dumps(figures))
        return
    share = figures["hit_tokens"] / ideal if ideal else 0.0
    print(
        f"{figures['mode']} on {trace_name} trace ({requests:,} requests), {args.blocks:,} "
        f"blocks, {args.eviction} eviction"
        f"{', write-through' if args.write_through else ''}"
        f"{', family keep rules' if args.family_keep else ''}: {figures['events']} events in "
        f"{figures['seconds']:.3f} s = "
        f"{figures['events_per_s']:,.0f} events/s ({figures['events_per_cpu_s']:,.0f} per CPU "
        f"second); {figures['prompt_tokens_hashed_per_s']:,.0f} "
        f"prompt tokens hashed/s; hit tokens {figures['hit_tokens']:,} of ideal {ideal:,} "
        f"({share:.1%}); peak blocks {figures['peak_blocks']:,}; waits {figures['waits']}"
    )
    if args.host_blocks:
        by_tier = ", ".join(
            f"{tier} {tokens:,}" for tier, tokens in figures["hit_tokens_by_tier"].items()
        )
        moved = ", ".join(f"{kind} {blocks:,}" for kind, blocks in figures["blocks_moved"].items())
        print(f"hit tokens by tier: {by_tier}; blocks moved: {moved or 'none'}")


if __name__ == "__main__":
    main()
