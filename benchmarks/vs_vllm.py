"""Side by side, in one process: kvspec's KVCacheAllocator against vLLM 0.33's v1 KVCacheManager.

Both replay the same pre-generated events of a trace (``--trace shared``: the shared-system-
prompt request trace, ``--trace chat``: the multi-turn chat trace; the in-package copies of
``shared/bench/request_trace.py`` / ``chat_trace.py``, same events for the same seed) on the
same model shape: block size 16, prefix caching on, ``--blocks`` blocks in one pool, one
full-attention group (default); with ``--hybrid``, a Gemma-2-like sliding window 4096 + full
attention pair; with ``--mamba``, ``replay_trace.py --mamba``'s Jamba-like pair: a Mamba-1
state group (per layer conv (8192, 3) bf16 + SSM (8192, 16) fp32, ``mamba_cache_mode="align"``)
and full attention (8 KV heads x 256, bf16; its page padded to the state's, as vLLM lays two
groups over one pool). Runs alternate (kvspec, vLLM, kvspec batched, kvspec, vLLM, ...), each on
a fresh allocator / manager, ``--repeat`` times; the medians are printed.

kvspec is driven exactly as ``benchmarks/replay_trace.py`` drives it (``replay``); with
``--batched`` also through :meth:`KVCacheAllocator.decode_step`, one call per run of
consecutive decode events (one engine step: its request ids and sampled tokens). vLLM is
driven as its scheduler drives the manager, without the scheduler itself:

* admit: a ``vllm.v1.request.Request`` built as the engine core builds it (the block hasher
  of ``get_request_block_hasher`` with the configured ``prefix_caching_hash_algo``, vLLM's
  default ``sha256``; ``init_none_hash`` first), then ``get_computed_blocks`` and
  ``allocate_slots(request, num_tokens - hit, num_new_computed_tokens=hit,
  new_computed_blocks=..., full_sequence_must_fit=True, has_scheduled_reqs=...)`` as
  ``Scheduler.schedule`` does for a waiting request (``scheduler_reserve_full_isl`` defaults
  to True); on success the request is RUNNING with ``num_computed_tokens`` = its length.
* decode: ``append_output_token_ids(token)`` (which hashes a newly full block), then
  ``allocate_slots(request, 1)`` and ``num_computed_tokens += 1``, as a running request's step.
* finish: ``free(request)``.

With ``--mamba`` the manager is built as the engine core builds it for such a model: the real
``MambaSpec`` (``MAMBA1``, no prefill checkpoint blocks, as vLLM's Mamba-1 mixer declares it)
and ``KVCacheConfig(prefix_cache_retention_interval=...)`` at ``CacheConfig``'s default ``0``
(Mamba states kept only at the prompt's replay boundary and at shared-prefix junctions;
``--vllm-retention-interval dense`` keeps every block-boundary state, a positive multiple of 16
also one per interval). A prefill is chunked as ``Scheduler.schedule`` chunks it in align mode:
each chunk is one engine step (``new_step_starts`` first, so a state cached by an earlier event
counts as cached in an earlier step) of at most ``--vllm-max-num-batched-tokens`` less one
token per other running request (their decodes are scheduled first in a step), clipped by the
scheduler's own ``Scheduler._mamba_block_aligned_split`` (called on a stand-in holding only the
attributes it reads, set as ``Scheduler.__init__`` sets them). For a prompt of ``L`` tokens
its steps then end, past the hit, at the shared-prefix junction ``get_computed_blocks``
reports (the full-attention hit when the Mamba hit is shorter: kvspec's ``checkpoint_at``), at
the end of every budget-sized chunk floored to 16 tokens, at ``(L - 1) // 16 * 16`` (the last
block boundary before the final token) and at ``L``; kvspec's driver ends them only at
``checkpoint_at`` and ``L``. The first chunk is allocated as a waiting request's
(``full_sequence_must_fit=True``), later ones as a running request's
``allocate_slots(request, n)``; if one of those finds too few blocks the request is freed and
queued again (the scheduler would preempt it; kvspec's driver frees it the same way). The
groups are in kvspec's order (full attention first), which is the order ``free`` returns
their blocks in.

Before each run, once its allocator or manager is built, the heap is frozen (``gc.freeze()``,
as vLLM's engine core freezes it once its scheduler and KV-cache manager are built), for both
sides alike; it is unfrozen after the run.

Both sides queue a request whose admission finds too few blocks, retry the queue head after
every finish, and skip the events of queued requests, the same way. Request construction and
hashing are inside the timed region on both sides. Figures: events per second of wall time
and of process CPU time (less sensitive to other processes on a shared machine), their ratios
to vLLM's (of the medians, and the median of each round's ratio), hit tokens.

Needs vLLM 0.33 importable (not a kvspec dependency); see the README's Benchmarks section for
the side environment ``.venv-vllm``::

    .venv-vllm/bin/python benchmarks/vs_vllm.py [--trace shared|chat] [--hybrid | --mamba]
        [--batched] [--blocks 32768] [--requests N] [--seed 0] [--repeat 5]
        [--vllm-hash-algo sha256] [--vllm-max-num-batched-tokens 8192]
        [--vllm-retention-interval 0|dense|N] [--json]
"""

from __future__ import annotations

import argparse
import collections
import gc
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
    MAX_MODEL_LEN,
    MODELS,
    TRACES,
    build_allocator,
    model_name,
    replay,
)

#: Sliding window of ``--hybrid`` (Gemma-2's).
SLIDING_WINDOW = 4096
#: ``--mamba``'s per-layer Mamba-1 state (Jamba-1.5-Mini's, as ``replay_trace.py --mamba``):
#: conv (d_inner, d_conv - 1) bf16, SSM (d_inner, d_state) fp32.
MAMBA_SHAPES = ((8192, 3), (8192, 16))
MAMBA_DTYPES = (torch.bfloat16, torch.float32)
#: Default engine token budget per step: vLLM's ``max_num_batched_tokens`` for the OpenAI
#: server on H100 / H200 (``EngineArgs.get_batch_defaults``).
MAX_NUM_BATCHED_TOKENS = 8192


def _import_vllm() -> Any:
    try:
        import vllm
        from vllm.v1.core import kv_cache_manager  # noqa: F401
    except ImportError as error:
        sys.exit(
            f"vs_vllm.py needs vLLM 0.33 importable ({error}); create the side environment "
            "described in README.md, section Benchmarks, and run this script with "
            ".venv-vllm/bin/python"
        )
    if not vllm.__version__.startswith("0.33"):
        print(f"warning: vLLM {vllm.__version__} is not 0.33", file=sys.stderr)
    return vllm


def build_vllm_manager(
    num_blocks: int,
    model: str | bool,
    hash_algo: str,
    retention_interval: int | None = 0,
    max_model_len: int = MAX_MODEL_LEN,
) -> tuple[Any, Callable]:
    """vLLM's KVCacheManager for one of ``replay_trace.MODELS`` (``True`` / ``False``:
    hybrid or not), and the engine core's request block hasher. ``retention_interval``:
    ``KVCacheConfig.prefix_cache_retention_interval`` of the Mamba hybrid (the others keep
    the manager's default, dense)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(model, bool):
        model = "hybrid" if model else "full_attention"
    if model not in MODELS:
        raise ValueError(f"model={model!r} must be one of {MODELS}")
    attention = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=256, dtype=torch.bfloat16)
    extra: dict[str, Any] = {}
    if model == "mamba_hybrid":
        state = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=MAMBA_SHAPES,
            dtypes=MAMBA_DTYPES,
            mamba_type=MambaAttentionBackendEnum.MAMBA1,
            mamba_cache_mode="align",
        )
        # The attention page padded to the (larger) state page: one page size per pool.
        groups = [
            KVCacheGroupSpec(
                ["model.layers.1.self_attn"],
                FullAttentionSpec(page_size_padded=state.page_size_bytes, **attention),
            ),
            KVCacheGroupSpec(["model.layers.0.mamba"], state),
        ]
        extra["prefix_cache_retention_interval"] = retention_interval
    else:
        groups = [KVCacheGroupSpec(["model.layers.1.self_attn"], FullAttentionSpec(**attention))]
    if model == "hybrid":
        groups.append(
            KVCacheGroupSpec(
                ["model.layers.0.self_attn"],
                SlidingWindowSpec(sliding_window=SLIDING_WINDOW, **attention),
            )
        )
    page = groups[0].kv_cache_spec.page_size_bytes
    # One backing tensor shared by one layer of each group (the groups' pages are the same
    # size), as vLLM lays out a hybrid model's groups over one pool of blocks.
    tensor = KVCacheTensor(
        size=page * num_blocks,
        layers=[group.layer_names[0] for group in groups],
        layer_stride=0,
        block_stride=page,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=groups, **extra
    )
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    manager = KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    return manager, hasher


def mamba_align_split(manager: Any, max_num_batched_tokens: int) -> Callable[..., int]:
    """vLLM's ``Scheduler._mamba_block_aligned_split`` bound to a stand-in scheduler: the
    attributes it reads, set as ``Scheduler.__init__`` sets them for ``manager``'s model
    (no EAGLE, no hash lookahead, hash block = block, default ``SchedulerConfig``)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = manager.kv_cache_config.kv_cache_groups
    states = [group.kv_cache_spec for group in groups if isinstance(group.kv_cache_spec, MambaSpec)]
    if not states or any(spec.mamba_cache_mode != "align" for spec in states):
        raise ValueError("mamba_align_split needs Mamba groups in align mode")
    hash_block_size = manager.block_pool.hash_block_size
    partial_cache_hit = (
        hash_block_size < BLOCK_SIZE and manager.coordinator.enable_partial_hash_hits
    )
    stand_in = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        hash_block_size=hash_block_size,
        mamba_partial_cache_hit=partial_cache_hit,
        mamba_shared_prefix_checkpoint=(
            partial_cache_hit and manager.mamba_shared_prefix_checkpoint
        ),
        mamba_has_prefill_checkpoint_blocks=all(
            spec.num_prefill_checkpoint_blocks > 0 for spec in states
        ),
        mamba_prefill_checkpoint_alignment=states[0].prefill_checkpoint_alignment,
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,
        max_num_scheduled_tokens=max_num_batched_tokens,
        scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
    )
    return Scheduler._mamba_block_aligned_split.__get__(stand_in)


def replay_vllm(
    events: list[tuple],
    manager: Any,
    hasher: Callable,
    max_num_batched_tokens: int | None = None,
) -> dict[str, float | int]:
    """The events through vLLM's manager (see the module docstring), same loop as kvspec's.
    ``max_num_batched_tokens``: chunk prefills as the scheduler does in Mamba align mode
    (the manager's model must have Mamba groups in align mode); ``None``: one step each."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    sampling = SamplingParams(max_tokens=MAX_MODEL_LEN)
    requests: dict[int, Any] = {}
    waiting: collections.OrderedDict[int, Any] = collections.OrderedDict()
    pool = manager.block_pool
    usable = pool.num_gpu_blocks - 1  # the null block is never handed out
    get_computed_blocks = manager.get_computed_blocks
    allocate_slots = manager.allocate_slots
    new_step_starts = manager.new_step_starts
    running = RequestStatus.RUNNING
    split = (
        None
        if max_num_batched_tokens is None
        else mamba_align_split(manager, max_num_batched_tokens)
    )
    hit_tokens = prompt_tokens = peak = waits = dropped = decode_stalls = 0

    def prefill_chunks(request: Any, blocks: Any, hit: int) -> bool:
        """The prompt in align-mode chunks, one engine step each (module docstring)."""
        assert split is not None and max_num_batched_tokens is not None
        # Running requests' decodes are scheduled first in a step.
        budget = max_num_batched_tokens - len(requests)
        num_new = split(request, min(request.num_tokens - hit, budget), hit, 0)
        if (
            num_new == 0
            or allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                full_sequence_must_fit=True,
                has_scheduled_reqs=bool(requests),
            )
            is None
        ):
            return False
        request.status = running
        request.num_computed_tokens = hit + num_new
        while request.num_computed_tokens < request.num_tokens:
            new_step_starts()
            num_new = split(request, min(request.num_tokens - request.num_computed_tokens, budget))
            if num_new == 0 or allocate_slots(request, num_new) is None:
                # The scheduler would preempt it: freed, computed tokens reset, queued.
                manager.free(request)
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                return False
            request.num_computed_tokens += num_new
        return True

    def admit(rid: int, request: Any) -> bool:
        nonlocal hit_tokens, peak
        if split is None:
            blocks, hit, _ = get_computed_blocks(request)
            if (
                allocate_slots(
                    request,
                    request.num_tokens - hit,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    full_sequence_must_fit=True,
                    has_scheduled_reqs=bool(requests),
                )
                is None
            ):
                return False
            request.status = running
            request.num_computed_tokens = request.num_tokens
        else:
            new_step_starts()
            blocks, hit, request.shared_prefix_boundary = get_computed_blocks(request)
            if not prefill_chunks(request, blocks, hit):
                return False
        hit_tokens += hit
        used = usable - pool.get_num_free_blocks()
        if used > peak:
            peak = used
        requests[rid] = request
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
            request.append_output_token_ids(event[2])
            if allocate_slots(request, 1) is None:
                decode_stalls += 1
                continue
            request.num_computed_tokens += 1
            used = usable - pool.get_num_free_blocks()
            if used > peak:
                peak = used
        elif kind == "admit":
            rid = event[1]
            request = Request(str(rid), list(event[2]), sampling, None, block_hasher=hasher)
            prompt_tokens += request.num_tokens
            if waiting or not admit(rid, request):
                waits += 1
                waiting[rid] = request
        else:
            rid = event[1]
            if rid in waiting:
                del waiting[rid]
                dropped += 1
            else:
                manager.free(requests.pop(rid))
            # The queue is retried after any finish, a queued one's too (replay_trace.replay).
            while waiting:
                head_id, head = next(iter(waiting.items()))
                if not admit(head_id, head):
                    waits += 1
                    break
                del waiting[head_id]
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return {
        "events": len(events),
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "events_per_s": len(events) / elapsed,
        "events_per_cpu_s": len(events) / cpu,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "peak_blocks": peak,
        "waits": waits,
        "dropped_events": dropped,
        "decode_stalls": decode_stalls,
    }


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def _retention_interval(value: str) -> int | None:
    if value == "dense":
        return None
    interval = int(value)
    if interval < 0 or interval % BLOCK_SIZE:
        raise argparse.ArgumentTypeError(
            f"must be 'dense' or a non-negative multiple of {BLOCK_SIZE}"
        )
    return interval


def interleaved_runs(
    sides: dict[str, tuple[Callable[[], Any], Callable[[Any], dict[str, Any]]]], repeat: int
) -> dict[str, list[dict[str, Any]]]:
    """``repeat`` rounds of one run per side (side name -> (build, run of what was built)),
    in order within each round; each side's runs' figures."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, (build, run) in sides.items():
            built = build()
            # As vLLM's engine core does once its scheduler and KV-cache manager are built
            # (EngineCore.__init__: freeze_gc_heap): the start-up heap, the allocator or
            # manager included, leaves the collector's generations.
            gc.collect()
            gc.freeze()
            runs[name].append(run(built))
            del built
            gc.unfreeze()
            gc.collect()
    return runs


def compare(events: list[tuple], args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved runs of every side; per side its medians and each run's figures."""
    model = model_name(args)
    chunked = model == "mamba_hybrid"
    # Per side: build the allocator / manager, then the replay of it.
    sides: dict[str, tuple[Callable[[], Any], Callable[[Any], dict[str, Any]]]] = {
        "kvspec": (
            lambda: build_allocator(args.blocks, model),
            lambda allocator: replay(events, allocator),
        ),
        "vllm": (
            lambda: build_vllm_manager(
                args.blocks, model, args.vllm_hash_algo, args.vllm_retention_interval
            ),
            lambda built: replay_vllm(
                events, *built, args.vllm_max_num_batched_tokens if chunked else None
            ),
        ),
    }
    if args.batched:
        sides["kvspec_batched"] = (
            lambda: build_allocator(args.blocks, model),
            lambda allocator: replay(events, allocator, batched=True),
        )
    runs = interleaved_runs(sides, args.repeat)
    summary: dict[str, Any] = {}
    for name, side_runs in runs.items():
        first = side_runs[0]
        for other in side_runs[1:]:
            if other["hit_tokens"] != first["hit_tokens"]:
                raise SystemExit(f"{name}: hit tokens differ between runs of the same trace")
        summary[name] = {
            "events_per_s": _median(side_runs, "events_per_s"),
            "events_per_cpu_s": _median(side_runs, "events_per_cpu_s"),
            "hit_tokens": first["hit_tokens"],
            "peak_blocks": first["peak_blocks"],
            "waits": first["waits"],
            "dropped_events": first["dropped_events"],
            "decode_stalls": first["decode_stalls"],
            "runs_events_per_cpu_s": [run["events_per_cpu_s"] for run in side_runs],
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=tuple(TRACES), default="shared")
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--hybrid",
        action="store_true",
        help="sliding window 4096 + full attention sharing one pool",
    )
    model.add_argument(
        "--mamba",
        action="store_true",
        help="Mamba-1 state (align mode) + full attention sharing one pool",
    )
    parser.add_argument(
        "--batched",
        action="store_true",
        help="also replay kvspec through decode_step, one call per step",
    )
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests in the trace (default: the trace's own)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5, help="runs of each side (median)")
    parser.add_argument(
        "--vllm-hash-algo",
        default="sha256",
        help="vLLM's prefix_caching_hash_algo (default: vLLM's own, sha256)",
    )
    parser.add_argument(
        "--vllm-max-num-batched-tokens",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help="--mamba: vLLM's token budget per step, chunking prefills "
        f"(default {MAX_NUM_BATCHED_TOKENS}, the H100/H200 server's)",
    )
    parser.add_argument(
        "--vllm-retention-interval",
        type=_retention_interval,
        default=0,
        help="--mamba: vLLM's prefix_cache_retention_interval, 'dense' for "
        "None (default 0, vLLM's: states at replay boundaries and "
        "shared-prefix junctions only)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.repeat < 1 or args.blocks < 2:
        parser.error("--repeat must be >= 1 and --blocks >= 2")
    if args.vllm_max_num_batched_tokens < BLOCK_SIZE:
        parser.error(f"--vllm-max-num-batched-tokens must be >= {BLOCK_SIZE}")
    vllm = _import_vllm()
    make_trace, default_requests = TRACES[args.trace]
    requests = default_requests if args.requests is None else args.requests
    events = list(make_trace(seed=args.seed, num_requests=requests))
    summary = compare(events, args)
    model = model_name(args)
    header = {
        "trace": args.trace,
        "model": model,
        "blocks": args.blocks,
        "events": len(events),
        "repeat": args.repeat,
        "vllm_version": vllm.__version__,
        "vllm_hash_algo": args.vllm_hash_algo,
    }
    setting = ""
    if model == "mamba_hybrid":
        retention = args.vllm_retention_interval
        header.update(
            vllm_max_num_batched_tokens=args.vllm_max_num_batched_tokens,
            vllm_retention_interval=retention,
        )
        setting = (
            f", {args.vllm_max_num_batched_tokens:,} tokens per step, retention "
            f"{'dense' if retention is None else retention}"
        )
    base = summary["vllm"]
    for figures in summary.values():
        figures["speedup_wall"] = figures["events_per_s"] / base["events_per_s"]
        figures["speedup_cpu"] = figures["events_per_cpu_s"] / base["events_per_cpu_s"]
        # Each round's runs are adjacent in time, so a change of the machine's load between
        # rounds moves both sides of a round alike: the median of the rounds' ratios.
        figures["speedup_cpu_rounds"] = statistics.median(
            run / vllm_run
            for run, vllm_run in zip(
                figures["runs_events_per_cpu_s"], base["runs_events_per_cpu_s"], strict=True
            )
        )
    if args.json:
        print(json.dumps({**header, **summary}))
        return
    print(
        f"{model} on {args.trace} trace ({len(events):,} events), {args.blocks:,} blocks, "
        f"vLLM {vllm.__version__} ({args.vllm_hash_algo}{setting}); median of {args.repeat} "
        "interleaved runs:"
    )
    for name, figures in summary.items():
        print(
            f"  {name:15} {figures['events_per_s']:>10,.0f} events/s "
            f"{figures['events_per_cpu_s']:>10,.0f} per CPU s  "
            f"x{figures['speedup_wall']:5.2f} wall x{figures['speedup_cpu']:5.2f} CPU "
            f"(x{figures['speedup_cpu_rounds']:5.2f} per round)  "
            f"hit tokens {figures['hit_tokens']:,}  peak blocks {figures['peak_blocks']:,}  "
            f"waits {figures['waits']}"
        )


if __name__ == "__main__":
    main()
