"""Side by side, in one process: kvspec's tiered allocator against vLLM 0.33's KVCacheManager
with its OffloadingConnector's CPU tier (``vllm/v1/kv_offload``, LRU), on the same events.

Full attention (default) or, with ``--hybrid``, ``vs_vllm.py --hybrid``'s sliding window
4096 + full attention pair (vLLM 0.33's connector offloads both groups: a sliding-window group's
lookup reaches back only its window, ``sliding_window_size_in_chunks``); block 16, ``--blocks``
device blocks and ``--host-blocks`` host blocks on both sides (vLLM keys a CPU chunk by block
hash and group, so a hybrid's chunk is one group's page, as a kvspec host block is); transfers
are instant (every load and store is confirmed before the next step) on both. ``--mamba``:
``vs_vllm.py --mamba``'s Jamba-like pair, a Mamba-1 state group (``mamba_cache_mode="align"``)
and full attention; vLLM's connector offloads both groups (a Mamba state is one chunk, found by
a one-chunk window lookup and offered for storing only through the manager's boundary-state
hand-off), kvspec's host tier both groups' blocks; see the ``--mamba`` paragraph below.

On the Mooncake trace ``--hybrid`` prefills in chunks of 16,384 tokens on both sides, as
``replay_trace.py --hybrid`` does (kvspec's sliding-window group admits at most
``max_in_flight_tokens`` per step); vLLM's first chunk is allocated as a waiting request's,
later ones as a running request's, each a step through the connector. vLLM's retention
(``prefix_cache_retention_interval``) is the manager's, dense, for the connector too (as one
cache config gives both in an engine; ``CacheConfig``'s default ``0`` would store a sliding
window's chunks only where a prompt ends).

kvspec: ``replay_trace.replay`` of ``build_allocator(..., host_blocks=N, eviction=E)``
(write-back: a cached block evicted from the device goes to the host tier; ``--eviction``:
its order on the device and on the host tier, ``lru`` or ``segmented``); ``--mamba``: the
same replay with vLLM's step ends (its ``prefill_split``; below).

vLLM: its own classes, driven as ``Scheduler.schedule`` / ``update_from_output`` drive them,
without the scheduler itself (it needs a model and an engine): the ``KVCacheManager`` of
``vs_vllm.build_vllm_manager``, and the scheduler side of ``OffloadingConnector`` built from a
real ``VllmConfig`` (``kv_connector="OffloadingConnector"``, ``kv_role="kv_both"``, its
``CPUOffloadingSpec`` with ``eviction_policy="lru"`` (``--vllm-eviction arc``: its ARC),
``cpu_bytes_to_use`` = host blocks x the block's bytes, ``blocks_per_chunk`` 1: an offloaded
chunk is one 16-token GPU block, the
configuration closest to kvspec's; every other setting vLLM's default, so
``offload_prompt_only`` is on and stores are write-through: a request's prompt blocks are
offered to the CPU tier in the step that computes them). The model config is the one thing
not built: this process has no model, and of it the connector reads only ``use_mla`` (False)
and the model's name, dtype and length; they are given in a stand-in. Per event:

* admit: ``Request`` as in ``vs_vllm.py``, ``OffloadingConnector.on_new_request`` (the
  scheduler's ``add_request``), then ``get_computed_blocks`` (the GPU prefix hit) and
  ``get_num_new_matched_tokens(request, gpu_hit)`` (the CPU hit beyond it). Without a CPU
  hit: ``allocate_slots`` as in ``vs_vllm.py``, ``update_state_after_alloc(request, blocks,
  0)`` and one step. With one (vLLM loads asynchronously by default): ``allocate_slots(request,
  0, ..., num_external_computed_tokens=cpu_hit, delay_cache_blocks=True)``,
  ``update_state_after_alloc`` (the connector's ``prepare_load``), a step carrying the load,
  the load confirmed, then as ``Scheduler._update_waiting_for_remote_kv``: ``cache_blocks``
  (a whole-prompt hit gives back its last token to recompute), and a step with the rest of the
  prompt (``allocate_slots`` as a running request's).
* a step: a real ``SchedulerOutput`` (``NewRequestData`` for a request's first step,
  ``CachedRequestData`` with this step's new block ids otherwise, ``finished_req_ids``) given
  to ``build_connector_meta`` (where the connector decides what to store and calls
  ``prepare_store``), ``num_computed_tokens`` advanced (``_update_after_schedule``), then every
  load and store job of the step confirmed through ``update_connector_output`` (a worker's
  ``OffloadingWorkerMetadata.completed_jobs``).
* decode: as in ``vs_vllm.py``; a run of consecutive decode events is one step per round: a
  step ends before a request's second decode in it (a request decodes once per step).
* finish: status ``FINISHED_LENGTH_CAPPED``, ``request_finished`` (the connector's, before the
  blocks are freed, as ``Scheduler._free_request``), ``free``, and a step with the request in
  ``finished_req_ids``.

Every step starts with ``new_step_starts`` (``Scheduler.schedule``'s first manager call) and
hands the connector the manager's ``take_boundary_state_offloads()`` in a
``KVConnectorBlockState``, as ``schedule`` does (empty but for a Mamba group); a step whose
manager queued a copy-on-write block copy (``take_kv_cache_block_copies``: a sub-block hit,
impossible with 16-token hash blocks) is refused rather than run without it.

``--mamba``: a prefill is chunked as ``Scheduler.schedule`` chunks it in align mode, on both
sides: each chunk one engine step of at most ``--vllm-max-num-batched-tokens`` (8,192) less one
token per running request (their decodes come first in a step), clipped by the scheduler's own
``_mamba_block_aligned_split`` (``vs_vllm.mamba_align_split``), and, for a running request, by
``max_model_len``. vLLM's admission is the scheduler's waiting-request path with a connector:
the local hit is ``Scheduler._get_local_prefix_cache_hit``'s (bound to this connector and
manager; ``OffloadingConnector`` does not declare ``supports_divergent_local_hybrid_hits``, so
that is ``get_computed_blocks``' hit, on which every group agrees, and ``hit_diverged`` is
False; the reconciliation branch is run as the scheduler runs it all the same), the connector
is asked with the block-aligned local hit (a sub-block tail is kept or dropped as the scheduler
does), then either the first chunk, split from the local hit plus the connector's tokens
(``_mamba_block_aligned_split(..., num_new_local_computed_tokens,
num_external_computed_tokens)``), allocated with them, or an async load (``allocate_slots(...,
num_external_computed_tokens, delay_cache_blocks=True, skip_zeroing_group_ids=...)``, the
load's step, ``_update_waiting_for_remote_kv``'s ``cache_blocks``), after which the rest of the
prompt is chunked from the loaded position, its first chunk allocated as a waiting request's
(if vLLM refuses that chunk, the request waits holding its loaded blocks, as in the
scheduler's ``kv_holding_waiting``, and is retried like any waiting request, without a new
lookup; its hit is counted at the load's allocation, where vLLM's statistics record it; if the
trace finishes it before it runs, it is aborted: ``FINISHED_ABORTED``, the connector's
finish, ``free``).
A finish makes ``Scheduler._connector_finished``'s calls: ``finalize_partial_tail_offloads``
(refused if it returns a tail: none without sub-block hits), ``remove_skipped_blocks`` and
``request_finished_all_groups``. Retention (``--vllm-retention-interval``, default dense: every
state a step computed is kept, as kvspec keeps them) is the manager's and the connector's alike.
kvspec's replay otherwise ends a prefill step only at ``checkpoint_at`` and the prompt's end,
so a Mamba hit could only end there: here its steps end where vLLM's scheduler would end them
for kvspec's own hit (vLLM's split function, called on both sides, on a stand-in request at
kvspec's hit whose shared-prefix junction is kvspec's ``checkpoint_at``, as vLLM's is
``get_computed_blocks``' ``shared_prefix_boundary``; the budget less kvspec's running
requests), each step's transfers confirmed before the next; a later step kvspec refuses frees
the request and queues it again, as ``replay_trace.replay`` does. vLLM steps this replay cannot
run as the scheduler would are refused, naming the request: a later chunk with no blocks (the
scheduler would preempt), a chunk the split leaves empty, a synchronous or deferred load.
What remains approximate, as for the other models: the trace's events are sequential, so an
admission's prefill steps run back to back, one admission per step, without the decodes that
running requests would run in those steps (their tokens are only taken from the budget); a
finish is a step of its own; and a decode that finds no free block is skipped and counted
(``decode_stalls``, on both sides) where the scheduler would preempt a request.

Hit tokens: the GPU part is ``get_computed_blocks``' hit, the CPU part the connector's
(``num_external_computed_tokens``), as vLLM's prefix-cache statistics count them. Both sides
queue a request whose admission finds too few blocks, as ``vs_vllm.py``. Figures per side: hit
tokens (by tier), blocks stored and loaded, process CPU time of the replay and per event;
``--mamba`` also prefill steps (engine steps that ran prefill tokens).

    .venv-vllm/bin/python benchmarks/vs_vllm_offload.py [--trace shared|chat|mooncake[:FILE]]
        [--hybrid | --mamba] [--blocks 32768] [--host-blocks 262144] [--requests N]
        [--repeat 1] [--eviction lru|segmented] [--vllm-eviction lru|arc]
        [--vllm-max-num-batched-tokens 8192] [--vllm-retention-interval dense|0|N] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from replay_trace import (
    BLOCK_SIZE,
    build_allocator,
    engine_steps,
    load_trace,
    replay,
)
from vs_vllm import (
    MAX_NUM_BATCHED_TOKENS,
    _import_vllm,
    _retention_interval,
    build_vllm_manager,
    interleaved_runs,
    mamba_align_split,
)

from kvspec_core.runtime import Request
from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES

#: The models both sides are driven on here (``vs_vllm.py``'s names).
DRIVEN_MODELS = ("full_attention", "hybrid", "mamba_hybrid")
MODEL_TITLES = {
    "full_attention": "full attention",
    "hybrid": "sliding window 4096 + full attention",
    "mamba_hybrid": "Mamba-1 (align) + full attention",
}


def build_vllm_offloading(
    num_blocks: int,
    host_blocks: int,
    max_model_len: int,
    hash_algo: str,
    eviction: str = "lru",
    model: str = "full_attention",
    retention_interval: int | None = None,
) -> tuple[Any, Any, Any]:
    """vLLM's KVCacheManager for ``model`` (one of :data:`DRIVEN_MODELS`, as
    ``vs_vllm.build_vllm_manager`` builds them) with the scheduler side of its
    OffloadingConnector on a CPU tier of ``host_blocks`` 16-token chunks (``eviction``: its
    ``lru`` or ``arc`` policy; the tier keys a chunk by block hash and group, so a hybrid's
    chunk is one group's page, as a kvspec host block is); and the engine core's request
    block hasher. ``retention_interval``: the Mamba hybrid's
    ``prefix_cache_retention_interval`` (``None``: dense), the manager's and the
    connector's."""
    if model not in DRIVEN_MODELS:
        raise ValueError(f"model={model!r}: this replay drives {DRIVEN_MODELS} only")
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    if model == "mamba_hybrid":
        manager, hasher = build_vllm_manager(
            num_blocks, model, hash_algo, retention_interval, max_model_len
        )
    else:
        manager, hasher = build_vllm_manager(
            num_blocks, model, hash_algo, max_model_len=max_model_len
        )
    kv_cache_config = manager.kv_cache_config
    block_bytes = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        # The connector's retention as the manager's (a real engine gives both the cache
        # config's): dense for full attention and the sliding-window hybrid
        # (vs_vllm.build_vllm_manager), where CacheConfig's default, 0, would store a sliding
        # window's blocks only at a prompt's end; the Mamba hybrid's as asked.
        cache_config=CacheConfig(
            block_size=16,
            enable_prefix_caching=True,
            prefix_cache_retention_interval=kv_cache_config.prefix_cache_retention_interval,
            **({"mamba_cache_mode": "align"} if model == "mamba_hybrid" else {}),
        ),
        scheduler_config=SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": host_blocks * block_bytes,
                "eviction_policy": eviction,
                "blocks_per_chunk": 1,
            },
        ),
    )
    # No model in this process: the connector reads only these of its config.
    model = types.SimpleNamespace(
        use_mla=False,
        model="replay",
        dtype=torch.bfloat16,
        max_model_len=max_model_len,
        get_total_num_kv_heads=lambda: 8,
    )
    object.__setattr__(vllm_config, "model_config", model)
    connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    connector.bind_kv_cache_manager(manager)
    chunks = connector.scheduler.manager._num_chunks
    if chunks != host_blocks:
        raise SystemExit(
            f"vLLM's CPU tier has {chunks:,} chunks, not the {host_blocks:,} asked for "
            f"({block_bytes:,} bytes per block; its alignment rounds the chunk up)"
        )
    return manager, connector, hasher


def replay_vllm_offloading(
    events: list[tuple],
    manager: Any,
    connector: Any,
    hasher: Any,
    max_model_len: int,
    prefill_chunk: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> dict[str, Any]:
    """The events through vLLM's manager and offloading connector (module docstring);
    ``prefill_chunk``: a prompt's computed part in steps of at most that many tokens;
    ``max_num_batched_tokens``: the Mamba hybrid's align-mode chunking with that token budget
    per step (the manager's model must have Mamba groups in align mode)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.core.sched.output import (
        CachedRequestData,
        KVConnectorBlockState,
        NewRequestData,
        SchedulerOutput,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus

    sampling = SamplingParams(max_tokens=max_model_len)
    requests: dict[int, Any] = {}
    waiting: collections.OrderedDict[int, Any] = collections.OrderedDict()
    pool = manager.block_pool
    usable = pool.num_gpu_blocks - 1
    get_computed_blocks = manager.get_computed_blocks
    allocate_slots = manager.allocate_slots
    running = RequestStatus.RUNNING
    new_step_starts = manager.new_step_starts
    take_boundary_state_offloads = manager.take_boundary_state_offloads
    take_kv_cache_block_copies = manager.take_kv_cache_block_copies
    hit_gpu = hit_cpu = prompt_tokens = peak = waits = dropped = decode_stalls = 0
    blocks_stored = blocks_loaded = whole_prompt_loads = prefill_steps = 0

    def step(
        new: list[Any],
        cached: list[tuple[Any, Any]],
        scheduled: dict[str, int],
        finished: set[str],
    ) -> None:
        """One engine step: the connector's metadata, then every job done at once; then the
        next step starts (``Scheduler.schedule``'s first call)."""
        nonlocal blocks_stored, blocks_loaded
        new_data = [
            NewRequestData.from_request(request, manager.get_block_ids(request.request_id))
            for request in new
        ]
        cached_data = CachedRequestData(
            req_ids=[request.request_id for request, _ in cached],
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[blocks.get_block_ids(allow_none=True) for _, blocks in cached],
            num_computed_tokens=[request.num_computed_tokens for request, _ in cached],
            num_output_tokens=[request.num_output_tokens for request, _ in cached],
        )
        # As Scheduler.schedule: the Mamba "align" boundary states the manager committed
        # this step, with their exact blocks, for the connector (none for other groups).
        offloads = take_boundary_state_offloads()
        copies, _ = take_kv_cache_block_copies()
        if copies:
            raise SystemExit(
                f"a step with {len(copies)} copy-on-write block copies (a sub-block hit): the "
                "replay does not run them"
            )
        output = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
            kv_connector_block_state=KVConnectorBlockState(
                req_ids={*scheduled, *offloads},
                resolve_block_ids=manager.get_block_ids,
                boundary_state_offloads=offloads,
            ),
        )
        meta = connector.build_connector_meta(output)
        for request in new:
            request.num_computed_tokens += scheduled[request.request_id]
        for request, _ in cached:
            request.num_computed_tokens += scheduled[request.request_id]
        jobs = {**meta.load_jobs, **meta.store_jobs}
        if jobs:
            for job in meta.store_jobs.values():
                blocks_stored += len(job.dst_spec.block_ids)
            for job in meta.load_jobs.values():
                blocks_loaded += len(job.src_spec.block_ids)
            worker = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1))
            connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker))
        new_step_starts()

    def run_load(request: Any, computed: int) -> None:
        """An async load's step (its job confirmed), then
        ``Scheduler._update_waiting_for_remote_kv``: the loaded blocks cached, a whole-prompt
        load giving back its last token to recompute; the request waits again."""
        nonlocal whole_prompt_loads
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = computed
        step([], [], {}, set())
        manager.cache_blocks(request, computed)
        if computed == request.num_tokens:
            request.num_computed_tokens = computed - 1
            whole_prompt_loads += 1
        request.status = RequestStatus.WAITING

    def first_chunk(remaining: int) -> int:
        return remaining if prefill_chunk is None else min(remaining, prefill_chunk)

    def later_chunks(rid: int, request: Any) -> None:
        """The rest of a chunked prefill, one step each, as a running request's."""
        while request.num_computed_tokens < request.num_tokens:
            chunk = first_chunk(request.num_tokens - request.num_computed_tokens)
            new_blocks = allocate_slots(request, chunk)
            if new_blocks is None:
                # The scheduler would preempt a request here; kvspec's replay never does.
                raise SystemExit(f"request {rid}: no blocks for a later prefill chunk")
            step([], [(request, new_blocks)], {request.request_id: chunk}, set())

    def allocate_admission(
        request: Any, num_new: int, local: int, blocks: Any, external: int, **loading: Any
    ) -> bool:
        """A waiting request's first allocation with its local hit and the connector's
        tokens (``loading``: an async load's options), the connector told, and the hit
        counted where vLLM's statistics record it: at this allocation."""
        nonlocal hit_gpu, hit_cpu
        new_blocks = allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=local,
            new_computed_blocks=blocks,
            num_external_computed_tokens=external,
            full_sequence_must_fit=True,
            has_scheduled_reqs=bool(requests),
            **loading,
        )
        if new_blocks is None:
            return False
        connector.update_state_after_alloc(
            request, manager.get_blocks(request.request_id), external
        )
        hit_gpu += local
        hit_cpu += external
        return True

    def admit(rid: int, request: Any) -> bool:
        nonlocal peak
        blocks, local, _ = get_computed_blocks(request)
        external, load_async = connector.get_num_new_matched_tokens(request, local)
        if external is None:
            raise SystemExit(f"request {rid}: the connector deferred its lookup")
        num_tokens = request.num_tokens
        if not external:
            first = first_chunk(num_tokens - local)
            if not allocate_admission(request, first, local, blocks, 0):
                return False
            request.status = running
            request.num_computed_tokens = local
            step([request], [], {request.request_id: first}, set())
            later_chunks(rid, request)
        else:
            if not load_async:
                raise SystemExit(f"request {rid}: a synchronous load (not configured)")
            if not allocate_admission(request, 0, local, blocks, external, delay_cache_blocks=True):
                return False
            run_load(request, local + external)
            first = first_chunk(num_tokens - request.num_computed_tokens)
            new_blocks = allocate_slots(
                request, first, full_sequence_must_fit=True, has_scheduled_reqs=bool(requests)
            )
            if new_blocks is None:
                raise SystemExit(f"request {rid}: no blocks for the rest of a loaded prompt")
            connector.update_state_after_alloc(request, new_blocks, 0)
            request.status = running
            step([request], [], {request.request_id: first}, set())
            later_chunks(rid, request)
        used = usable - pool.get_num_free_blocks()
        if used > peak:
            peak = used
        requests[rid] = request
        return True

    aligned = max_num_batched_tokens is not None
    if max_num_batched_tokens is not None:
        budget = max_num_batched_tokens
        split = mamba_align_split(manager, budget)
        # The scheduler's own local lookup, bound to the attributes it reads.
        local_hit = Scheduler._get_local_prefix_cache_hit.__get__(
            types.SimpleNamespace(connector=connector, kv_cache_manager=manager)
        )
        get_loaded_group_ids = connector.get_loaded_kv_cache_group_ids

    def aligned_chunks(rid: int, request: Any, room: int) -> None:
        """The rest of an align-mode prefill, one step each, as a running request's
        (``Scheduler.schedule``'s running loop: budget, ``max_model_len``, split)."""
        nonlocal prefill_steps
        while request.num_computed_tokens < request.num_tokens:
            computed = request.num_computed_tokens
            size = min(request.num_tokens - computed, room, max_model_len - computed - 1)
            size = split(request, size)
            if size <= 0:
                raise SystemExit(
                    f"request {rid}: the align-mode split leaves a later prefill chunk at "
                    f"{computed:,} empty (the scheduler would skip it every step)"
                )
            new_blocks = allocate_slots(request, size)
            if new_blocks is None:
                raise SystemExit(
                    f"request {rid}: no blocks for a later prefill chunk at {computed:,} (the "
                    "scheduler would preempt a request; not reproduced)"
                )
            step([], [(request, new_blocks)], {request.request_id: size}, set())
            prefill_steps += 1

    def admit_aligned(rid: int, request: Any) -> bool:
        """``Scheduler.schedule``'s waiting-request path with a connector, Mamba align mode
        (module docstring)."""
        if request.num_computed_tokens:
            # Loaded earlier, waiting with its blocks: no lookup (the scheduler's
            # num_computed_tokens > 0 branch).
            return run_after_load(rid, request)
        blocks, local, request.shared_prefix_boundary, hit_diverged = local_hit(request)
        partial_tail = local % BLOCK_SIZE
        block_aligned_local = local - partial_tail
        external, load_async = connector.get_num_new_matched_tokens(request, block_aligned_local)
        if external is None:
            raise SystemExit(f"request {rid}: the connector deferred its lookup")
        if partial_tail and external > partial_tail:
            blocks = manager.truncate_computed_blocks(blocks, block_aligned_local)
            local = block_aligned_local
        elif partial_tail:
            external, load_async = 0, False
        if hit_diverged and not external:
            # No external tokens back the deeper local hit: the boundary every group agrees on.
            blocks, local, request.shared_prefix_boundary = get_computed_blocks(request)
        if external and not load_async:
            raise SystemExit(f"request {rid}: a synchronous load (not configured)")
        computed = local + external
        num_tokens = request.num_tokens
        if load_async:
            loading = {
                "delay_cache_blocks": True,
                "skip_zeroing_group_ids": get_loaded_group_ids(request),
            }
            if not allocate_admission(request, 0, local, blocks, external, **loading):
                return False
            run_load(request, computed)  # then the waiting path again
            return run_after_load(rid, request)
        # Running requests' decodes are scheduled first in a step.
        room = budget - len(requests)
        first = split(request, min(num_tokens - computed, room), local, external)
        if first <= 0:
            return False
        if not allocate_admission(request, first, local, blocks, external):
            return False
        request.status = running
        request.num_computed_tokens = computed
        step([request], [], {request.request_id: first}, set())
        run_prefill(rid, request, room)
        return True

    def run_after_load(rid: int, request: Any) -> bool:
        """A loaded request's first chunk, from the loaded position, allocated as a waiting
        request's; if vLLM refuses it, the request waits holding its blocks (retried as any
        waiting request is)."""
        room = budget - len(requests)
        computed = request.num_computed_tokens
        first = split(request, min(request.num_tokens - computed, room))
        if first <= 0:
            return False
        if (
            allocate_slots(
                request, first, full_sequence_must_fit=True, has_scheduled_reqs=bool(requests)
            )
            is None
        ):
            return False
        connector.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
        request.status = running
        step([request], [], {request.request_id: first}, set())
        run_prefill(rid, request, room)
        return True

    def run_prefill(rid: int, request: Any, room: int) -> None:
        """After a prefill's first step: its later chunks; the request runs."""
        nonlocal peak, prefill_steps
        prefill_steps += 1
        aligned_chunks(rid, request, room)
        used = usable - pool.get_num_free_blocks()
        if used > peak:
            peak = used
        requests[rid] = request

    def finish(rid: int) -> None:
        request = requests.pop(rid)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        if aligned:
            connector_finished(request)
        else:
            connector.request_finished(request, manager.get_block_ids(request.request_id)[0])
        manager.free(request)
        step([], [], {}, {request.request_id})

    def connector_finished(request: Any) -> None:
        """Scheduler._connector_finished (kv_both: a producer)."""
        if manager.finalize_partial_tail_offloads(request):
            raise SystemExit(f"request {request.request_id}: a partial-tail offload at its finish")
        manager.remove_skipped_blocks(
            request_id=request.request_id,
            processed_computed_tokens=max(
                0, request.num_computed_tokens - request.num_in_flight_tokens
            ),
            num_prompt_tokens=request.num_prompt_tokens,
        )
        connector.request_finished_all_groups(
            request,
            manager.get_block_ids_for_computed_tokens(
                request_id=request.request_id, num_computed_tokens=request.num_computed_tokens
            ),
        )

    def decode_step(cached: list[tuple[Any, Any]]) -> None:
        nonlocal peak
        step([], cached, {request.request_id: 1 for request, _ in cached}, set())
        used = usable - pool.get_num_free_blocks()
        if used > peak:
            peak = used

    admit_request = admit_aligned if aligned else admit

    start = time.perf_counter()
    cpu_start = time.process_time()
    for event in engine_steps(events):
        kind = event[0]
        if kind == "step":
            # A run of decode events: one engine step per round, a request decoding at most
            # once in each (a run between two admissions or finishes holds many rounds).
            cached = []
            in_step: set[int] = set()
            for rid, token in zip(event[1], event[2], strict=True):
                request = requests.get(rid)
                if request is None:
                    dropped += 1
                    continue
                if rid in in_step:
                    if cached:
                        decode_step(cached)
                        cached = []
                    in_step.clear()
                in_step.add(rid)
                request.append_output_token_ids(token)
                new_blocks = allocate_slots(request, 1)
                if new_blocks is None:
                    decode_stalls += 1
                    continue
                cached.append((request, new_blocks))
            if cached:
                decode_step(cached)
        elif kind == "admit":
            rid = event[1]
            request = Request(str(rid), list(event[2]), sampling, None, block_hasher=hasher)
            connector.on_new_request(request)
            prompt_tokens += request.num_tokens
            if waiting or not admit_request(rid, request):
                waits += 1
                waiting[rid] = request
                # The step ends without it (the scheduler still builds the connector's
                # metadata, which closes the step its lookup opened).
                step([], [], {}, set())
        else:
            rid = event[1]
            if rid in waiting:
                request = waiting.pop(rid)
                dropped += 1
                if request.num_computed_tokens:
                    # Loaded, waiting with its blocks: it ends without having run (aborted).
                    request.status = RequestStatus.FINISHED_ABORTED
                    connector_finished(request)
                    manager.free(request)
                    step([], [], {}, {request.request_id})
            else:
                finish(rid)
            # The queue is retried after any finish, a queued one's too (replay_trace.replay).
            while waiting:
                head_id, head = next(iter(waiting.items()))
                if not admit_request(head_id, head):
                    waits += 1
                    step([], [], {}, set())
                    break
                del waiting[head_id]
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return {
        "events": len(events),
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "cpu_us_per_event": cpu / len(events) * 1e6,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_gpu + hit_cpu,
        "hit_tokens_by_tier": {"device": hit_gpu, "host": hit_cpu},
        "blocks_stored": blocks_stored,
        "blocks_loaded": blocks_loaded,
        "whole_prompt_loads": whole_prompt_loads,
        **({"prefill_steps": prefill_steps} if aligned else {}),
        "peak_blocks": peak,
        "waits": waits,
        "dropped_events": dropped,
        "decode_stalls": decode_stalls,
    }


def replay_kvspec(
    events: list[tuple],
    allocator: Any,
    prefill_chunk: int | None = None,
    prefill_split: Callable[[Request, Any, int], list[int]] | None = None,
) -> dict[str, Any]:
    """``replay_trace.replay`` with the figures named as vLLM's side names them."""
    figures = replay(events, allocator, prefill_chunk=prefill_chunk, prefill_split=prefill_split)
    moved = figures["blocks_moved"]
    figures["cpu_us_per_event"] = figures["cpu_seconds"] / figures["events"] * 1e6
    figures["blocks_stored"] = moved.get("device->host", 0)
    figures["blocks_loaded"] = moved.get("host->device", 0)
    return figures


def replay_kvspec_aligned(
    events: list[tuple],
    allocator: Any,
    split: Callable[..., int],
    max_num_batched_tokens: int,
    max_model_len: int,
) -> dict[str, Any]:
    """:func:`replay_kvspec` with a prompt's prefill steps ending where vLLM's scheduler
    would end them for kvspec's own hit: ``split`` (vLLM's ``_mamba_block_aligned_split``,
    ``vs_vllm.mamba_align_split``) on a stand-in request at that hit, its shared-prefix
    junction kvspec's ``checkpoint_at``; the budget ``max_num_batched_tokens`` less one token
    per running request; later chunks as a running request's (the budget,
    ``max_model_len``, the split). A later step the allocator refuses frees the request and
    queues it again, as ``replay`` does."""

    def prefill_split(request: Request, prefix: Any, running: int) -> list[int]:
        hit = prefix.num_tokens
        num_tokens = len(request.token_ids)
        room = max_num_batched_tokens - running
        stand_in = types.SimpleNamespace(
            num_computed_tokens=hit,
            num_tokens=num_tokens,
            num_prompt_tokens=num_tokens,
            shared_prefix_boundary=prefix.checkpoint_at or 0,
        )
        first = split(stand_in, min(num_tokens - hit, room))
        if first <= 0:
            return []  # vLLM's scheduler would leave it waiting
        steps = [first]
        end = hit + first
        while end < num_tokens:
            stand_in.num_computed_tokens = end
            size = split(stand_in, min(num_tokens - end, room, max_model_len - end - 1))
            if size <= 0:
                raise SystemExit(
                    f"request {request.request_id}: the align-mode split leaves a later "
                    f"prefill chunk at {end:,} empty"
                )
            steps.append(size)
            end += size
        return steps

    return replay_kvspec(events, allocator, prefill_split=prefill_split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="mooncake", metavar="shared|chat|mooncake[:FILE]")
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--host-blocks", type=int, default=262144)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each side (median)")
    parser.add_argument("--vllm-hash-algo", default="sha256")
    parser.add_argument(
        "--vllm-eviction",
        choices=("lru", "arc"),
        default="lru",
        help="the CPU tier's cache policy in vLLM (default lru, vLLM's)",
    )
    parser.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default=DEFAULT_EVICTION,
        help=f"kvspec's eviction order, on the device and on the host tier "
        f"(default {DEFAULT_EVICTION})",
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--hybrid",
        action="store_true",
        help="vs_vllm.py --hybrid's sliding window 4096 + full attention pair",
    )
    model.add_argument(
        "--mamba",
        action="store_true",
        help="vs_vllm.py --mamba's Mamba-1 (align) + full attention pair, prefills chunked "
        "as vLLM's scheduler chunks them in align mode",
    )
    parser.add_argument(
        "--vllm-max-num-batched-tokens",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help=f"--mamba: vLLM's token budget per step (default {MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument(
        "--vllm-retention-interval",
        type=_retention_interval,
        default=None,
        help="--mamba: vLLM's prefix_cache_retention_interval, the manager's and the "
        "connector's (default 'dense', every state a step computed, as kvspec keeps them; 0 "
        "is vLLM's own default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.blocks < 2 or args.host_blocks < 1 or args.repeat < 1:
        parser.error("--blocks must be >= 2, --host-blocks >= 1, --repeat >= 1")
    if args.vllm_max_num_batched_tokens < BLOCK_SIZE:
        parser.error(f"--vllm-max-num-batched-tokens must be >= {BLOCK_SIZE}")
    model_name = "mamba_hybrid" if args.mamba else "hybrid" if args.hybrid else "full_attention"
    budget = args.vllm_max_num_batched_tokens if args.mamba else None
    vllm = _import_vllm()
    try:
        events, requests, trace_file, max_model_len, prefill_chunk = load_trace(
            args.trace, args.requests, model_name == "hybrid"
        )
    except ValueError as error:
        parser.error(str(error))
    trace_name = args.trace.partition(":")[0]

    def build_kvspec() -> tuple[Any, ...]:
        allocator = build_allocator(
            args.blocks,
            model_name,
            eviction=args.eviction,
            max_model_len=max_model_len,
            host_blocks=args.host_blocks,
        )
        if budget is None:
            return (allocator,)
        # The split of vLLM's scheduler, on a manager of the same model (its attributes only).
        manager, _ = build_vllm_manager(
            BLOCK_SIZE, model_name, args.vllm_hash_algo, args.vllm_retention_interval
        )
        return allocator, mamba_align_split(manager, budget)

    def run_kvspec(built: tuple[Any, ...]) -> dict[str, Any]:
        if budget is None:
            return replay_kvspec(events, *built, prefill_chunk=prefill_chunk)
        allocator, split = built
        return replay_kvspec_aligned(events, allocator, split, budget, max_model_len)

    sides = {
        "kvspec": (build_kvspec, run_kvspec),
        "vllm": (
            lambda: build_vllm_offloading(
                args.blocks,
                args.host_blocks,
                max_model_len,
                args.vllm_hash_algo,
                args.vllm_eviction,
                model_name,
                args.vllm_retention_interval,
            ),
            lambda built: replay_vllm_offloading(
                events, *built, max_model_len, prefill_chunk, budget
            ),
        ),
    }
    runs = interleaved_runs(sides, args.repeat)
    summary: dict[str, Any] = {}
    for name, side_runs in runs.items():
        figures = dict(side_runs[0])
        if any(run["hit_tokens"] != figures["hit_tokens"] for run in side_runs):
            raise SystemExit(f"{name}: hit tokens differ between runs of the same trace")
        figures["cpu_seconds"] = statistics.median(run["cpu_seconds"] for run in side_runs)
        figures["cpu_us_per_event"] = statistics.median(
            run["cpu_us_per_event"] for run in side_runs
        )
        figures["runs_cpu_seconds"] = [run["cpu_seconds"] for run in side_runs]
        summary[name] = figures
    header = {
        "trace": trace_name,
        "trace_file": trace_file,
        "requests": requests,
        "events": len(events),
        "blocks": args.blocks,
        "host_blocks": args.host_blocks,
        "model": model_name,
        "prefill_chunk": prefill_chunk,
        "kvspec_eviction": args.eviction,
        "vllm_version": vllm.__version__,
        "vllm_hash_algo": args.vllm_hash_algo,
        "vllm_offload": {
            "cpu_chunks": args.host_blocks,
            "blocks_per_chunk": 1,
            "policy": args.vllm_eviction,
        },
        "repeat": args.repeat,
    }
    setting = ""
    if budget is not None:
        retention = args.vllm_retention_interval
        header.update(vllm_max_num_batched_tokens=budget, vllm_retention_interval=retention)
        setting = (
            f", {budget:,} tokens per step, retention {'dense' if retention is None else retention}"
        )
    if args.json:
        print(json.dumps({**header, **summary}))
        return
    print(
        f"{MODEL_TITLES[model_name]} on {trace_name} trace ({requests:,} requests, "
        f"{len(events):,} events), "
        f"{args.blocks:,} device + {args.host_blocks:,} host blocks, vLLM {vllm.__version__} "
        f"OffloadingConnector CPU {args.vllm_eviction.upper()}, kvspec {args.eviction}"
        f"{setting}; median of {args.repeat}:"
    )
    for name, figures in summary.items():
        tiers = figures["hit_tokens_by_tier"]
        print(
            f"  {name:7} hit tokens {figures['hit_tokens']:>11,} (device {tiers['device']:,}, "
            f"host {tiers['host']:,})  stored {figures['blocks_stored']:,} loaded "
            f"{figures['blocks_loaded']:,} blocks  CPU {figures['cpu_seconds']:.2f} s = "
            f"{figures['cpu_us_per_event']:.1f} us/event  waits {figures['waits']}"
            + (f"  prefill steps {figures['prefill_steps']:,}" if budget is not None else "")
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
