"""Replay a request trace through a plan's allocator, as a simple engine would drive it.

Engine model (one event at a time, no batching of compute):

* ``admit``: find the cached prefix and allocate slots for the whole prompt (in two steps
  when the allocator names a ``checkpoint_at`` position, so that state groups save a
  checkpoint where the prompt shares content with earlier ones). A "not now"
  for lack of blocks queues the request; queued requests retry, in arrival order, after
  every finish. A request over the admission cap (longer than ``max_model_len``) can never
  run and is rejected.
* ``decode``: append the token and allocate one slot. When blocks are short the request is
  preempted (its blocks freed, recomputed later from its tokens, as engines do) and queued
  first in line; a request reaching ``max_model_len`` stops generating (truncated), and so
  does a preempted one whose tokens no longer fit the admission cap when it retries. A
  request in the queue (never admitted yet, or preempted) generates nothing: the fixed
  trace's decodes for it are dropped and counted (``dropped_decodes``); re-admitted, it
  decodes the trace's later ones.
* ``finish``: free the request (or drop it from the queue: the fixed trace ends it, so a
  request that waited until then never ran and is counted as never admitted).

Hit tokens and prompt tokens count every admission, re-admissions after preemption included.

Offload tiers (an allocator built with ``offload_tiers``): the simulator moves no data, so
after every call that may record transfers (an admission, a decode that took a block) it
takes them (``take_transfers``) and confirms them all at once (``complete_transfers(ok=True)``),
as if each copy finished before the step's forward. No transfer fails and none is slow:
the figures are the cache policy's (what was hit where, what had to move), not copy times.
:class:`TierTraffic` counts, per tier, the hit tokens (``TieredPrefix.tokens_by_tier``), the
blocks (and, given each pool's block bytes, the bytes) loaded to the device, stored into the
tier and demoted to the next tier, and the admissions that had to wait for a load from it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvspec_core.runtime.allocator import KVCacheAllocator
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import OVER_ADMISSION_CAP, CachedPrefix
from kvspec_core.runtime.tiers import DEVICE_TIER, LOAD, TieredPrefix, Transfer


@attrs.define
class TierTraffic:
    """One tier's side of a replay (``name``: ``"device"``, ``"host"``, ``"disk"``...).

    Attributes:
        hit_tokens: prefix-hit tokens served from this tier (``TieredPrefix.tokens_by_tier``;
            the tiers' figures add up to the report's ``hit_tokens``).
        load_waits: admissions that waited for a load from this tier before their forward
            (0 for the device).
        loaded_blocks / loaded_bytes: copied from this tier to the device (tier hits).
        stored_blocks / stored_bytes: copied into this tier (the device's evictions into the
            first tier; a tier's evictions into the next).
        demoted_blocks / demoted_bytes: copied from this tier to the next one down.
    Bytes are blocks x the block bytes of their pool (a tier block is a device block's
    pages); 0 when the simulation was not given the pools' block bytes.
    """

    name: str
    hit_tokens: int = 0
    load_waits: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    demoted_blocks: int = 0
    demoted_bytes: int = 0


def count_transfer(tiers: list[TierTraffic], transfer: Transfer, block_bytes: int) -> None:
    """Add ``transfer`` (of blocks of ``block_bytes`` each) to the figures of the tiers it
    moves between."""
    blocks = transfer.num_blocks
    nbytes = blocks * block_bytes
    if transfer.kind == LOAD:
        tiers[transfer.source_tier].loaded_blocks += blocks
        tiers[transfer.source_tier].loaded_bytes += nbytes
        return
    tiers[transfer.destination_tier].stored_blocks += blocks
    tiers[transfer.destination_tier].stored_bytes += nbytes
    if transfer.source_tier != DEVICE_TIER:
        tiers[transfer.source_tier].demoted_blocks += blocks
        tiers[transfer.source_tier].demoted_bytes += nbytes


@attrs.define
class SimulationReport:
    """What a replay measured (``prefix_hit_rate`` = hit tokens / prompt tokens admitted)."""

    events: int = 0
    requests: int = 0
    admitted: int = 0
    never_admitted: int = 0
    readmissions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    #: Of ``hit_tokens``, those of re-admissions after preemption (mostly a request's own
    #: blocks still cached: not reuse across requests).
    readmission_hit_tokens: int = 0
    waited_admissions: int = 0
    wait_retries: int = 0
    rejected: int = 0
    preemptions: int = 0
    #: Decode events of requests in the queue at the time (see the module docstring).
    dropped_decodes: int = 0
    checkpoint_splits: int = 0
    truncated: int = 0
    peak_used_blocks: int = 0
    usable_blocks: int = 0
    #: Per pool, the most blocks requests held at once and the blocks it has: a pool that
    #: runs full while the others idle (a plan split for requests of ``max_model_len``
    #: serving shorter ones) is what makes admissions wait at a low overall peak.
    peak_used_blocks_by_pool: list[int] = attrs.field(factory=list)
    usable_blocks_by_pool: list[int] = attrs.field(factory=list)
    #: The most tokens a request held (prompt and decoded ones): what ``max_model_len``
    #: could be planned down to for this trace.
    longest_request_tokens: int = 0
    tiers: list[TierTraffic] = attrs.field(factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def peak_usage(self) -> float:
        return self.peak_used_blocks / self.usable_blocks if self.usable_blocks else 0.0

    @property
    def hit_tokens_by_tier(self) -> dict[str, int]:
        """Hit tokens per tier by name, the device first."""
        return {tier.name: tier.hit_tokens for tier in self.tiers}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = attrs.asdict(self)
        data["prefix_hit_rate"] = self.prefix_hit_rate
        data["peak_usage"] = self.peak_usage
        data["hit_tokens_by_tier"] = self.hit_tokens_by_tier
        return data


def simulate(
    allocator: KVCacheAllocator,
    events: Iterable[tuple],
    *,
    num_encoder_tokens: int = 0,
    on_event: Callable[[], None] | None = None,
    block_bytes: Sequence[int] | None = None,
) -> SimulationReport:
    """Replay ``events`` (see :mod:`kvspec_core.runtime.trace`) through ``allocator``;
    ``block_bytes``: each pool's bytes per block (a plan's ``pools[i].block_bytes``), for
    the bytes the tiers moved (0 without)."""
    pools = allocator.pools
    report = SimulationReport(
        usable_blocks=allocator.usage.usable_blocks,
        peak_used_blocks_by_pool=[0] * len(pools),
        usable_blocks_by_pool=[pool.num_usable_blocks for pool in pools],
        tiers=[TierTraffic(name) for name in allocator.tier_names],
    )
    tiers = report.tiers
    tiered = len(tiers) > 1
    pool_bytes = [0] * len(allocator.pools) if block_bytes is None else list(block_bytes)
    if len(pool_bytes) != len(allocator.pools):
        raise ValueError(
            f"block_bytes has {len(pool_bytes)} entries for the allocator's "
            f"{len(allocator.pools)} pools; give one per pool"
        )

    def run_transfers() -> None:
        # No real copies: each recorded transfer is confirmed at once (see the module doc).
        transfers = allocator.take_transfers()
        if transfers:
            for transfer in transfers:
                count_transfer(tiers, transfer, pool_bytes[transfer.pool])
            allocator.complete_transfers([transfer.transfer_id for transfer in transfers], True)

    def count_hit(prefix: CachedPrefix) -> None:
        if not isinstance(prefix, TieredPrefix):
            tiers[DEVICE_TIER].hit_tokens += prefix.num_tokens
            return
        for tier, tokens in enumerate(prefix.tokens_by_tier):
            tiers[tier].hit_tokens += tokens
        for tier in {tier for group in prefix.loads for _, tier, _ in group}:
            tiers[tier].load_waits += 1

    running: dict[object, Request] = {}
    waiting: collections.OrderedDict[object, Request] = collections.OrderedDict()
    ever_waited: set[object] = set()
    admitted: set[object] = set()
    stopped: set[object] = set()
    max_len = allocator.max_model_len
    pool_peaks = report.peak_used_blocks_by_pool

    def note_usage() -> None:
        used = [pool.num_used_blocks for pool in pools]
        pool_peaks[:] = map(max, pool_peaks, used)
        total = sum(used)
        if total > report.peak_used_blocks:
            report.peak_used_blocks = total

    def try_admit(request: Request) -> str:
        prefix = allocator.find_cached_prefix(request)
        remaining = len(request.token_ids) - prefix.num_tokens
        split = prefix.checkpoint_at
        first = split - prefix.num_tokens if split is not None else remaining
        result = allocator.allocate_slots(request, first, prefix=prefix)
        if not result:
            return result.reason  # type: ignore[union-attr]
        if split is not None:
            # The first step ended where the prompt shares content with earlier prompts,
            # so the state groups saved a checkpoint there; now the rest of the prompt.
            rest = allocator.allocate_slots(request, remaining - first)
            if not rest:
                if tiered:
                    run_transfers()  # the first step's, run before the request is freed
                allocator.free(request.request_id)
                return rest.reason  # type: ignore[union-attr]
            report.checkpoint_splits += 1
        if tiered:
            run_transfers()
        if request.request_id in admitted:
            report.readmissions += 1
            report.readmission_hit_tokens += prefix.num_tokens
        else:
            admitted.add(request.request_id)
            report.admitted += 1
        report.prompt_tokens += len(request.token_ids)
        report.longest_request_tokens = max(report.longest_request_tokens, len(request.token_ids))
        report.hit_tokens += prefix.num_tokens
        count_hit(prefix)
        running[request.request_id] = request
        note_usage()
        return ""

    def wait(request: Request, first: bool = False) -> None:
        waiting[request.request_id] = request
        if first:
            waiting.move_to_end(request.request_id, last=False)
        if request.request_id not in ever_waited:
            ever_waited.add(request.request_id)
            report.waited_admissions += 1

    def drain_queue() -> None:
        while waiting:
            head = next(iter(waiting.values()))
            reason = try_admit(head)
            if reason == OVER_ADMISSION_CAP:
                del waiting[head.request_id]
                stopped.add(head.request_id)
                if head.request_id in admitted:
                    # Preempted, its tokens now past the cap: it stops, as at max_model_len
                    # (counted once: admitted, not also rejected).
                    report.truncated += 1
                else:
                    report.rejected += 1
                continue
            if reason:
                report.wait_retries += 1
                return
            del waiting[head.request_id]

    for event in events:
        report.events += 1
        if on_event is not None:
            on_event()
        kind, rid = event[0], event[1]
        if kind == "admit":
            report.requests += 1
            request = Request(rid, list(event[2]), num_encoder_tokens=num_encoder_tokens)
            if waiting:
                wait(request)
                continue
            reason = try_admit(request)
            if reason == OVER_ADMISSION_CAP:
                report.rejected += 1
                stopped.add(rid)
            elif reason:
                wait(request)
        elif kind == "decode":
            if rid in stopped:
                continue
            decoding = running.get(rid)
            if decoding is None:
                # Queued: an engine generates nothing for it (its tokens so far are
                # recomputed when it is admitted again).
                if rid in waiting:
                    report.dropped_decodes += 1
                continue
            if len(decoding.token_ids) >= max_len:
                report.truncated += 1
                stopped.add(rid)
                continue
            decoding.append_token(event[2])
            result = allocator.allocate_slots(decoding, 1)
            if result:
                if len(decoding.token_ids) > report.longest_request_tokens:
                    report.longest_request_tokens = len(decoding.token_ids)
                if result is not allocator.no_new_blocks:
                    if tiered:
                        run_transfers()  # its new block may have evicted a cached one
                    note_usage()
                continue
            allocator.free(rid)
            del running[rid]
            report.preemptions += 1
            wait(decoding, first=True)
        else:
            stopped.discard(rid)
            if rid in running:
                allocator.free(rid)
                del running[rid]
            elif rid in waiting:
                del waiting[rid]
            drain_queue()
    report.never_admitted = report.requests - report.admitted - report.rejected
    return report
