"""Side by side, in one process: kvspec's tiered allocator against vLLM 0.33's KVCacheManager
with its OffloadingConnector's CPU tier (``vllm/v1/kv_offload``, LRU), on the same events.

Full attention (default) or, with ``--hybrid``, ``vs_vllm.py --hybrid``'s sliding window
4096 + full attention pair (vLLM 0.33's connector offloads both groups: a sliding-window group's
lookup reaches back only its window, ``sliding_window_size_in_chunks``); block 16, ``--blocks``
device blocks and ``--host-blocks`` host blocks on both sides (vLLM keys a CPU chunk by block
hash and group, so a hybrid's chunk is one group's page, as a kvspec host block is); transfers
are instant (every load and store is confirmed before the next step) on both. ``--mamba`` is
not replayed and says why (:data:`MAMBA_NOT_DRIVEN`: vLLM accepts it, its scheduler's
align-mode steps with a connector are not reproduced here).

On the Mooncake trace ``--hybrid`` prefills in chunks of 16,384 tokens on both sides, as
``replay_trace.py --hybrid`` does (kvspec's sliding-window group admits at most
``max_in_flight_tokens`` per step); vLLM's first chunk is allocated as a waiting request's,
later ones as a running request's, each a step through the connector. vLLM's retention
(``prefix_cache_retention_interval``) is the manager's, dense, for the connector too (as one
cache config gives both in an engine; ``CacheConfig``'s default ``0`` would store a sliding
window's chunks only where a prompt ends).

kvspec: ``replay_trace.replay`` of ``build_allocator(..., host_blocks=N, eviction=E)``
(write-back: a cached block evicted from the device goes to the host tier; ``--eviction``:
its order on the device and on the host tier, ``lru`` or ``segmented``).

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
* decode: as in ``vs_vllm.py``; each run of consecutive decode events is one step.
* finish: status ``FINISHED_LENGTH_CAPPED``, ``request_finished`` (the connector's, before the
  blocks are freed, as ``Scheduler._free_request``), ``free``, and a step with the request in
  ``finished_req_ids``.

Hit tokens: the GPU part is ``get_computed_blocks``' hit, the CPU part the connector's
(``num_external_computed_tokens``), as vLLM's prefix-cache statistics count them. Both sides
queue a request whose admission finds too few blocks, as ``vs_vllm.py``. Figures per side: hit
tokens (by tier), blocks stored and loaded, process CPU time of the replay and per event.

    .venv-vllm/bin/python benchmarks/vs_vllm_offload.py [--trace shared|chat|mooncake[:FILE]]
        [--hybrid | --mamba] [--blocks 32768] [--host-blocks 262144] [--requests N]
        [--repeat 1] [--eviction lru|segmented] [--vllm-eviction lru|arc] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import types
from typing import Any

import torch
from replay_trace import (
    build_allocator,
    engine_steps,
    load_trace,
    replay,
)
from vs_vllm import _import_vllm, build_vllm_manager, interleaved_runs

from kvspec_core.runtime.pool import DEFAULT_EVICTION, EVICTION_POLICIES

#: The models both sides are driven on here (``vs_vllm.py``'s names).
DRIVEN_MODELS = ("full_attention", "hybrid")
MODEL_TITLES = {
    "full_attention": "full attention",
    "hybrid": "sliding window 4096 + full attention",
}
#: Why ``--mamba`` is not replayed. vLLM 0.33's connector does accept the Mamba hybrid.
MAMBA_NOT_DRIVEN = (
    "--mamba: not driven. vLLM 0.33's OffloadingConnector accepts the Mamba hybrid (its "
    "offloading config gives a Mamba group a window of one chunk, its scheduler marks it "
    "requires_cow_source and offers partial-tail stores), so there is no vLLM refusal to "
    "report; but for such a model vLLM's Scheduler chunks a prefill in align mode counting "
    "the connector's external tokens (_mamba_block_aligned_split(..., "
    "num_external_computed_tokens)) and reconciles a local hit deeper than the Mamba "
    "state's (_get_local_prefix_cache_hit's hit_diverged) before asking the connector; "
    "this replay does not reproduce those steps, so it gives no Mamba figures rather than "
    "figures of a schedule vLLM would not run"
)


def build_vllm_offloading(
    num_blocks: int,
    host_blocks: int,
    max_model_len: int,
    hash_algo: str,
    eviction: str = "lru",
    model: str = "full_attention",
) -> tuple[Any, Any, Any]:
    """vLLM's KVCacheManager for ``model`` (``full_attention`` or ``hybrid``, as
    ``vs_vllm.build_vllm_manager`` builds them) with the scheduler side of its
    OffloadingConnector on a CPU tier of ``host_blocks`` 16-token chunks (``eviction``: its
    ``lru`` or ``arc`` policy; the tier keys a chunk by block hash and group, so a hybrid's
    chunk is one group's page, as a kvspec host block is); and the engine core's request
    block hasher."""
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

    manager, hasher = build_vllm_manager(num_blocks, model, hash_algo, max_model_len=max_model_len)
    kv_cache_config = manager.kv_cache_config
    block_bytes = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        # The connector's retention as the manager's (a real engine gives both the cache
        # config's): dense for these models (vs_vllm.build_vllm_manager), where CacheConfig's
        # default, 0, would store a sliding window's blocks only at a prompt's end.
        cache_config=CacheConfig(
            block_size=16,
            enable_prefix_caching=True,
            prefix_cache_retention_interval=kv_cache_config.prefix_cache_retention_interval,
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
) -> dict[str, Any]:
    """The events through vLLM's manager and offloading connector (module docstring);
    ``prefill_chunk``: a prompt's computed part in steps of at most that many tokens."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
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
    hit_gpu = hit_cpu = prompt_tokens = peak = waits = dropped = decode_stalls = 0
    blocks_stored = blocks_loaded = whole_prompt_loads = 0

    def step(
        new: list[Any],
        cached: list[tuple[Any, Any]],
        scheduled: dict[str, int],
        finished: set[str],
    ) -> None:
        """One engine step: the connector's metadata, then every job done at once."""
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

    def admit(rid: int, request: Any) -> bool:
        nonlocal hit_gpu, hit_cpu, peak, whole_prompt_loads
        blocks, local, _ = get_computed_blocks(request)
        external, load_async = connector.get_num_new_matched_tokens(request, local)
        if external is None:
            raise SystemExit(f"request {rid}: the connector deferred its lookup")
        num_tokens = request.num_tokens
        if not external:
            first = first_chunk(num_tokens - local)
            if (
                allocate_slots(
                    request,
                    first,
                    num_new_computed_tokens=local,
                    new_computed_blocks=blocks,
                    full_sequence_must_fit=True,
                    has_scheduled_reqs=bool(requests),
                )
                is None
            ):
                return False
            connector.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
            request.status = running
            request.num_computed_tokens = local
            step([request], [], {request.request_id: first}, set())
            later_chunks(rid, request)
        else:
            if not load_async:
                raise SystemExit(f"request {rid}: a synchronous load (not configured)")
            if (
                allocate_slots(
                    request,
                    0,
                    num_new_computed_tokens=local,
                    new_computed_blocks=blocks,
                    num_external_computed_tokens=external,
                    delay_cache_blocks=True,
                    full_sequence_must_fit=True,
                    has_scheduled_reqs=bool(requests),
                )
                is None
            ):
                return False
            connector.update_state_after_alloc(
                request, manager.get_blocks(request.request_id), external
            )
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = local + external
            step([], [], {}, set())  # the load runs; its job is confirmed
            # Scheduler._update_waiting_for_remote_kv
            manager.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens == num_tokens:
                request.num_computed_tokens = num_tokens - 1
                whole_prompt_loads += 1
            request.status = RequestStatus.WAITING
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
        hit_gpu += local
        hit_cpu += external
        used = usable - pool.get_num_free_blocks()
        if used > peak:
            peak = used
        requests[rid] = request
        return True

    def finish(rid: int) -> None:
        request = requests.pop(rid)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        connector.request_finished(request, manager.get_block_ids(request.request_id)[0])
        manager.free(request)
        step([], [], {}, {request.request_id})

    start = time.perf_counter()
    cpu_start = time.process_time()
    for event in engine_steps(events):
        kind = event[0]
        if kind == "step":
            cached = []
            for rid, token in zip(event[1], event[2], strict=True):
                request = requests.get(rid)
                if request is None:
                    dropped += 1
                    continue
                request.append_output_token_ids(token)
                new_blocks = allocate_slots(request, 1)
                if new_blocks is None:
                    decode_stalls += 1
                    continue
                cached.append((request, new_blocks))
            if cached:
                step([], cached, {request.request_id: 1 for request, _ in cached}, set())
                used = usable - pool.get_num_free_blocks()
                if used > peak:
                    peak = used
        elif kind == "admit":
            rid = event[1]
            request = Request(str(rid), list(event[2]), sampling, None, block_hasher=hasher)
            connector.on_new_request(request)
            prompt_tokens += request.num_tokens
            if waiting or not admit(rid, request):
                waits += 1
                waiting[rid] = request
                # The step ends without it (the scheduler still builds the connector's
                # metadata, which closes the step its lookup opened).
                step([], [], {}, set())
        else:
            rid = event[1]
            if rid in waiting:
                del waiting[rid]
                dropped += 1
                continue
            finish(rid)
            while waiting:
                head_id, head = next(iter(waiting.items()))
                if not admit(head_id, head):
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
        "peak_blocks": peak,
        "waits": waits,
        "dropped_events": dropped,
        "decode_stalls": decode_stalls,
    }


def replay_kvspec(
    events: list[tuple], allocator: Any, prefill_chunk: int | None = None
) -> dict[str, Any]:
    """``replay_trace.replay`` with the figures named as vLLM's side names them."""
    figures = replay(events, allocator, prefill_chunk=prefill_chunk)
    moved = figures["blocks_moved"]
    figures["cpu_us_per_event"] = figures["cpu_seconds"] / figures["events"] * 1e6
    figures["blocks_stored"] = moved.get("device->host", 0)
    figures["blocks_loaded"] = moved.get("host->device", 0)
    return figures


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
        help="vs_vllm.py --mamba's Mamba-1 + full attention pair (not driven: says why)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.blocks < 2 or args.host_blocks < 1 or args.repeat < 1:
        parser.error("--blocks must be >= 2, --host-blocks >= 1, --repeat >= 1")
    if args.mamba:
        raise SystemExit(MAMBA_NOT_DRIVEN)
    model_name = "hybrid" if args.hybrid else "full_attention"
    vllm = _import_vllm()
    try:
        events, requests, trace_file, max_model_len, prefill_chunk = load_trace(
            args.trace, args.requests, model_name == "hybrid"
        )
    except ValueError as error:
        parser.error(str(error))
    trace_name = args.trace.partition(":")[0]
    sides = {
        "kvspec": (
            lambda: (
                build_allocator(
                    args.blocks,
                    model_name,
                    eviction=args.eviction,
                    max_model_len=max_model_len,
                    host_blocks=args.host_blocks,
                ),
            ),
            lambda built: replay_kvspec(events, *built, prefill_chunk=prefill_chunk),
        ),
        "vllm": (
            lambda: build_vllm_offloading(
                args.blocks,
                args.host_blocks,
                max_model_len,
                args.vllm_hash_algo,
                args.vllm_eviction,
                model_name,
            ),
            lambda built: replay_vllm_offloading(events, *built, max_model_len, prefill_chunk),
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
    if args.json:
        print(json.dumps({**header, **summary}))
        return
    print(
        f"{MODEL_TITLES[model_name]} on {trace_name} trace ({requests:,} requests, "
        f"{len(events):,} events), "
        f"{args.blocks:,} device + {args.host_blocks:,} host blocks, vLLM {vllm.__version__} "
        f"OffloadingConnector CPU {args.vllm_eviction.upper()}, kvspec {args.eviction}; "
        f"median of {args.repeat}:"
    )
    for name, figures in summary.items():
        tiers = figures["hit_tokens_by_tier"]
        print(
            f"  {name:7} hit tokens {figures['hit_tokens']:>11,} (device {tiers['device']:,}, "
            f"host {tiers['host']:,})  stored {figures['blocks_stored']:,} loaded "
            f"{figures['blocks_loaded']:,} blocks  CPU {figures['cpu_seconds']:.2f} s = "
            f"{figures['cpu_us_per_event']:.1f} us/event  waits {figures['waits']}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
