"""Side by side, in one process: kvspec's KVCacheAllocator against vLLM 0.33's v1 KVCacheManager.

Both replay the same pre-generated events of a trace (``--trace shared``: the shared-system-
prompt request trace, ``--trace chat``: the multi-turn chat trace; the in-package copies of
``shared/bench/request_trace.py`` / ``chat_trace.py``, same events for the same seed) on the
same model shape: block size 16, prefix caching on, ``--blocks`` blocks in one pool, one
full-attention group (default) or, with ``--hybrid``, a Gemma-2-like sliding window 4096 +
full attention pair. Runs alternate (kvspec, vLLM, kvspec batched, kvspec, vLLM, ...), each on
a fresh allocator / manager, ``--repeat`` times; the medians are printed.

kvspec is driven exactly as ``benchmarks/replay_trace.py`` drives it (``replay``); with
``--batched`` also through :meth:`KVCacheAllocator.allocate_step`, one call per run of
consecutive decode events (one engine step). vLLM is driven as its scheduler drives the
manager, without the scheduler itself:

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

Both sides queue a request whose admission finds too few blocks, retry the queue head after
every finish, and skip the events of queued requests, the same way. Request construction and
hashing are inside the timed region on both sides. Figures: events per second of wall time
and of process CPU time (less sensitive to other processes on a shared machine), hit tokens.

Needs vLLM 0.33 importable (not a kvspec dependency); see the README's Benchmarks section for
the side environment ``.venv-vllm``::

    .venv-vllm/bin/python benchmarks/vs_vllm.py [--trace shared|chat] [--hybrid] [--batched]
        [--blocks 32768] [--requests N] [--seed 0] [--repeat 5] [--vllm-hash-algo sha256] [--json]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from replay_trace import BLOCK_SIZE, MAX_MODEL_LEN, TRACES, build_allocator, replay

#: Sliding window of ``--hybrid`` (Gemma-2's).
SLIDING_WINDOW = 4096


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


def build_vllm_manager(num_blocks: int, hybrid: bool, hash_algo: str) -> tuple[Any, Callable]:
    """vLLM's KVCacheManager for the model shape, and the engine core's request block hasher."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    attention = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=256, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.1.self_attn"], FullAttentionSpec(**attention))]
    if hybrid:
        groups.append(KVCacheGroupSpec(
            ["model.layers.0.self_attn"],
            SlidingWindowSpec(sliding_window=SLIDING_WINDOW, **attention),
        ))
    page = groups[0].kv_cache_spec.page_size_bytes
    # One backing tensor shared by one layer of each group (the groups' pages are the same
    # size), as vLLM lays out a hybrid model's groups over one pool of blocks.
    tensor = KVCacheTensor(size=page * num_blocks,
                           layers=[group.layer_names[0] for group in groups],
                           layer_stride=0, block_stride=page)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=groups)
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    manager = KVCacheManager(config, max_model_len=MAX_MODEL_LEN,
                             scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                             enable_caching=True)
    return manager, hasher


def replay_vllm(events: list[tuple], manager: Any, hasher: Callable) -> dict[str, float | int]:
    """The events through vLLM's manager (see the module docstring), same loop as kvspec's."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    sampling = SamplingParams(max_tokens=MAX_MODEL_LEN)
    requests: dict[int, Any] = {}
    waiting: collections.OrderedDict[int, Any] = collections.OrderedDict()
    pool = manager.block_pool
    usable = pool.num_gpu_blocks - 1  # the null block is never handed out
    get_computed_blocks = manager.get_computed_blocks
    allocate_slots = manager.allocate_slots
    running = RequestStatus.RUNNING
    hit_tokens = prompt_tokens = peak = waits = dropped = decode_stalls = 0

    def admit(rid: int, request: Any) -> bool:
        nonlocal hit_tokens, peak
        blocks, hit, _ = get_computed_blocks(request)
        if allocate_slots(request, request.num_tokens - hit, num_new_computed_tokens=hit,
                          new_computed_blocks=blocks, full_sequence_must_fit=True,
                          has_scheduled_reqs=bool(requests)) is None:
            return False
        request.status = running
        request.num_computed_tokens = request.num_tokens
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
                continue
            manager.free(requests.pop(rid))
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


def compare(events: list[tuple], args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved runs of every side; per side its medians and each run's figures."""
    sides: dict[str, Callable[[], dict[str, Any]]] = {
        "kvspec": lambda: replay(events, build_allocator(args.blocks, args.hybrid)),
        "vllm": lambda: replay_vllm(
            events, *build_vllm_manager(args.blocks, args.hybrid, args.vllm_hash_algo)
        ),
    }
    if args.batched:
        sides["kvspec_batched"] = lambda: replay(
            events, build_allocator(args.blocks, args.hybrid), batched=True
        )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(args.repeat):
        for name, run in sides.items():
            gc.collect()
            runs[name].append(run())
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
    parser.add_argument("--hybrid", action="store_true",
                        help="sliding window 4096 + full attention sharing one pool")
    parser.add_argument("--batched", action="store_true",
                        help="also replay kvspec through allocate_step, one call per step")
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in the trace (default: the trace's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5, help="runs of each side (median)")
    parser.add_argument("--vllm-hash-algo", default="sha256",
                        help="vLLM's prefix_caching_hash_algo (default: vLLM's own, sha256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.repeat < 1 or args.blocks < 2:
        parser.error("--repeat must be >= 1 and --blocks >= 2")
    vllm = _import_vllm()
    make_trace, default_requests = TRACES[args.trace]
    requests = default_requests if args.requests is None else args.requests
    events = list(make_trace(seed=args.seed, num_requests=requests))
    summary = compare(events, args)
    model = "hybrid" if args.hybrid else "full_attention"
    header = {"trace": args.trace, "model": model, "blocks": args.blocks, "events": len(events),
              "repeat": args.repeat, "vllm_version": vllm.__version__,
              "vllm_hash_algo": args.vllm_hash_algo}
    base = summary["vllm"]
    for name, figures in summary.items():
        figures["speedup_wall"] = figures["events_per_s"] / base["events_per_s"]
        figures["speedup_cpu"] = figures["events_per_cpu_s"] / base["events_per_cpu_s"]
    if args.json:
        print(json.dumps({**header, **summary}))
        return
    print(f"{model} on {args.trace} trace ({len(events):,} events), {args.blocks:,} blocks, "
          f"vLLM {vllm.__version__} ({args.vllm_hash_algo}); median of {args.repeat} "
          "interleaved runs:")
    for name, figures in summary.items():
        print(f"  {name:15} {figures['events_per_s']:>10,.0f} events/s "
              f"{figures['events_per_cpu_s']:>10,.0f} per CPU s  "
              f"x{figures['speedup_wall']:5.2f} wall x{figures['speedup_cpu']:5.2f} CPU  "
              f"hit tokens {figures['hit_tokens']:,}  peak blocks {figures['peak_blocks']:,}  "
              f"waits {figures['waits']}")


if __name__ == "__main__":
    main()
