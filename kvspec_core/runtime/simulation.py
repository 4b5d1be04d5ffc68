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
  first in line; a request reaching ``max_model_len`` stops generating (truncated).
* ``finish``: free the request (or drop it from the queue: the fixed trace ends it, so a
  request that waited until then never ran and is counted as never admitted).

Hit tokens and prompt tokens count every admission, re-admissions after preemption included.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import attrs

from kvspec_core.runtime.allocator import KVCacheAllocator
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import OVER_ADMISSION_CAP


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
    waited_admissions: int = 0
    wait_retries: int = 0
    rejected: int = 0
    preemptions: int = 0
    checkpoint_splits: int = 0
    truncated: int = 0
    peak_used_blocks: int = 0
    usable_blocks: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def peak_usage(self) -> float:
        return self.peak_used_blocks / self.usable_blocks if self.usable_blocks else 0.0

    def to_dict(self) -> dict[str, float | int]:
        data: dict[str, float | int] = attrs.asdict(self)
        data["prefix_hit_rate"] = self.prefix_hit_rate
        data["peak_usage"] = self.peak_usage
        return data


def simulate(
    allocator: KVCacheAllocator,
    events: Iterable[tuple],
    *,
    num_encoder_tokens: int = 0,
    on_event: Callable[[], None] | None = None,
) -> SimulationReport:
    """Replay ``events`` (see :mod:`kvspec_core.runtime.trace`) through ``allocator``."""
    report = SimulationReport(usable_blocks=allocator.usage.usable_blocks)
    running: dict[object, Request] = {}
    waiting: collections.OrderedDict[object, Request] = collections.OrderedDict()
    ever_waited: set[object] = set()
    admitted: set[object] = set()
    stopped: set[object] = set()
    pools = allocator.pools
    max_len = allocator.max_model_len

    def note_usage() -> None:
        used = sum(pool.num_used_blocks for pool in pools)
        if used > report.peak_used_blocks:
            report.peak_used_blocks = used

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
                allocator.free(request.request_id)
                return rest.reason  # type: ignore[union-attr]
            report.checkpoint_splits += 1
        if request.request_id in admitted:
            report.readmissions += 1
        else:
            admitted.add(request.request_id)
            report.admitted += 1
        report.prompt_tokens += len(request.token_ids)
        report.hit_tokens += prefix.num_tokens
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
            decoding = running.get(rid) or waiting.get(rid)
            if decoding is None:
                continue
            if len(decoding.token_ids) >= max_len:
                report.truncated += 1
                stopped.add(rid)
                continue
            decoding.append_token(event[2])
            if rid in waiting:
                continue  # recomputed with its tokens when it is admitted again
            result = allocator.allocate_slots(decoding, 1)
            if result:
                if result is not allocator.no_new_blocks:
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
