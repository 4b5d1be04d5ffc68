"""vLLM 0.32's scheduler step time on vLLM's own KV-cache manager vs kvspec's allocator
(``KVSPEC_VLLM_ALLOCATOR=1``, :mod:`kvspec_vllm.manager`), with the prefix hits of each.

Runs in the vLLM environment (``scripts/vllm-cpu-env``)::

    .venv-vllm-cpu/bin/python benchmarks/vllm_scheduler_step.py [--requests 256] [--model llama]

A real ``vllm.v1.core.sched.scheduler.Scheduler`` is built from a real ``VllmConfig`` (from
``EngineArgs`` on a shrunk config of the model; no weights, no engine) and a one-pool
``KVCacheConfig`` of ``--blocks`` blocks of 32 tokens. ``--requests`` requests arrive at
once: ``--families`` system prompts of ``--shared`` tokens, each request one of them plus a
suffix of its own (64-191 tokens), ``--output`` tokens generated (``ignore_eos``). Each step
is ``schedule()`` then ``update_from_output()``; between them (untimed) a :class:`KVOracle`
stands in for the model: it keeps the runner's block tables, writes a fingerprint of each
computed position's token prefix into its block and slot, and checks that every position
each query attends reads its own; the sampled token is a function of the request, the
position and what was read back, so a wrong block changes the tokens, and the bad reads
are counted per manager (the script exits 1 if kvspec's makes any, or the tokens differ).
Only the two scheduler calls are timed (``time.perf_counter``), nothing of a model. Both
managers run alternately ``--repeat`` times on fresh schedulers; per manager,
the step times of all its runs are pooled: median and p90 in microseconds of CPU time
(``time.process_time``, steadier on a shared machine) and of wall time; per run, the median
CPU time and the mean wall time; with the prefix hit tokens vLLM's ``PrefixCacheStats``
counted and the preemptions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
VOCAB = 512
MODELS = {"llama": "llama-3.1-8b", "mistral": "mistral-7b", "gemma2": "gemma-2-9b"}
SHRUNK = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "torch_dtype": "float32",
}


def write_config(model: str, folder: Path, window: int) -> Path:
    """A shrunk ``config.json`` of ``model`` (no weights: the scheduler needs none)."""
    from kvspec_core.models.catalog import load_preset

    config = {**load_preset(MODELS[model]), **SHRUNK}
    for field in ("quantization_config", "auto_map"):
        config.pop(field, None)
    if config.get("sliding_window"):
        config["sliding_window"] = window
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][: SHRUNK["num_hidden_layers"]]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def kv_cache_config(vllm_config: Any, num_blocks: int) -> Any:
    """One pool of ``num_blocks`` blocks, a group per layer kind, as vLLM groups them."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    hf = vllm_config.model_config.hf_text_config
    attention = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layer_types = getattr(hf, "layer_types", None) or (
        ["sliding_attention" if getattr(hf, "sliding_window", None) else "full_attention"]
        * hf.num_hidden_layers
    )
    groups: dict[str, list[str]] = {}
    for index, kind in enumerate(layer_types):
        groups.setdefault(kind, []).append(f"model.layers.{index}.self_attn")
    specs = []
    for kind, layers in groups.items():
        spec = (
            SlidingWindowSpec(sliding_window=hf.sliding_window, **attention)
            if kind == "sliding_attention"
            else FullAttentionSpec(**attention)
        )
        specs.append(KVCacheGroupSpec(layers, spec))
    page = specs[0].kv_cache_spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_blocks,
            layers=[group.layer_names[i] for group in specs],
            layer_stride=0,
            block_stride=page,
        )
        for i in range(max(len(group.layer_names) for group in specs))
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=specs)


def workload(num_requests: int, families: int, shared: int, seed: int = 0) -> list[list[int]]:
    """Prompts: family ``i % families``'s system prompt plus a suffix of the request's own."""
    import random

    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(shared)] for _ in range(families)]
    return [
        systems[index % families] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(64, 192))]
        for index in range(num_requests)
    ]


def sampled(request_id: str, position: int, read_back: int) -> int:
    """The token "the model" samples at ``position`` from ``read_back``, what its attention
    read (:meth:`KVOracle.compute`): the same under both managers only when both hand the
    runner blocks holding the right K/V."""
    return zlib.crc32(f"{request_id}:{position}:{read_back}".encode()) % (VOCAB - 1) + 1


class KVOracle:
    """What the model runner would read: the runner's block tables, kept from each
    ``SchedulerOutput`` as vLLM's ``gpu_model_runner._update_states`` keeps them (a new
    request takes its ``block_ids``, a resumed one replaces its table, a running one appends
    its ``new_block_ids``), and the K/V "written" at each computed position: a fingerprint
    of the token prefix up to it, in (group, block, slot). Each step's queries read back
    every position they attend (full attention: ``[0, p]``; a sliding window ``w``:
    ``[p-w+1, p]``); a slot that holds another prefix's K/V, or a position without a block,
    is a bad read (:attr:`bad_reads`). A manager that hands the runner a wrong block id, frees
    a block still attended or resumes a request on stale blocks makes some; vLLM's own
    manager makes none."""

    def __init__(self, windows: Sequence[int | None], block_size: int) -> None:
        self.windows = list(windows)
        self.block_size = block_size
        self.bad_reads = 0
        self._slots: dict[tuple[int, int], list[int | None]] = {}
        self._tables: dict[str, list[list[int]]] = {}
        self._fingerprints: dict[str, list[int]] = {}

    def update_tables(self, out: Any) -> None:
        """The runner's block tables after ``out`` (a ``SchedulerOutput``)."""
        for new in out.scheduled_new_reqs:
            self._tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for index, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[index]
            if rid in cached.resumed_req_ids:
                self._tables[rid] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for table, ids in zip(self._tables[rid], new_ids, strict=True):
                    table.extend(ids)
        for rid in out.finished_req_ids:
            self._tables.pop(rid, None)
            self._fingerprints.pop(rid, None)

    def _prefix_fingerprints(self, rid: str, tokens: Sequence[int], end: int) -> list[int]:
        # vLLM only appends to a request's tokens: the fingerprints so far stay valid.
        known = self._fingerprints.setdefault(rid, [])
        last = known[-1] if known else 0
        for token in tokens[len(known) : end]:
            last = zlib.crc32(token.to_bytes(4, "little"), last)
            known.append(last)
        return known

    def compute(self, rid: str, tokens: Sequence[int], start: int, end: int) -> int:
        """Write positions ``[start, end)`` of request ``rid`` (``tokens``: all its tokens),
        then read back what their queries attend; returns what the last query read at its
        own position (its prefix's fingerprint; -1 when any read was bad), for
        :func:`sampled`."""
        fingerprints = self._prefix_fingerprints(rid, tokens, end)
        size = self.block_size
        bad = 0
        for gid, window in enumerate(self.windows):
            table = self._tables[rid][gid]
            for position in range(start, end):
                index = position // size
                if index >= len(table) or table[index] == 0:
                    bad += 1
                    continue
                slots = self._slots.setdefault((gid, table[index]), [None] * size)
                slots[position % size] = fingerprints[position]
            low = 0 if window is None else max(0, start - window + 1)
            for index in range(low // size, (end - 1) // size + 1):
                first, last = max(low, index * size), min(end, (index + 1) * size)
                block = table[index] if index < len(table) else 0
                slots = self._slots.get((gid, block)) if block else None
                if slots is None:
                    bad += last - first
                    continue
                wanted = fingerprints[first:last]
                got = slots[first - index * size : last - index * size]
                if got != wanted:
                    bad += sum(1 for a, b in zip(got, wanted, strict=True) if a != b)
        self.bad_reads += bad
        return -1 if bad else fingerprints[end - 1]


def run(
    vllm_config: Any,
    prompts: Sequence[Sequence[int]],
    num_blocks: int,
    output: int,
    kvspec: bool,
) -> dict[str, Any]:
    """One run to completion: per-step times (s), hit tokens, preemptions, tokens, and the
    :class:`KVOracle`'s bad reads (K/V read from a block that does not hold it)."""
    from kvspec_vllm import scheduler_seam
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    cache_config = kv_cache_config(vllm_config, num_blocks)
    oracle = KVOracle(
        [
            getattr(group.kv_cache_spec, "sliding_window", None)
            for group in cache_config.kv_cache_groups
        ],
        BLOCK_SIZE,
    )
    (scheduler_seam.install if kvspec else scheduler_seam.uninstall)()
    try:
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            log_stats=True,
        )
    finally:
        scheduler_seam.uninstall()
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        scheduler.add_request(
            Request(
                f"r{index}", list(prompt), params, None, block_hasher=hasher, arrival_time=index
            )
        )
    times: list[float] = []
    cpu_times: list[float] = []
    hits = queries = preemptions = 0
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        start = time.perf_counter()
        cpu_start = time.process_time()
        out = scheduler.schedule()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        # "The model" (untimed): the runner's tables, the K/V it writes and reads back.
        oracle.update_tables(out)
        ids = list(out.num_scheduled_tokens)
        sampled_ids = []
        for rid, count in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            end = request.num_computed_tokens  # advanced past this step's tokens already
            read_back = oracle.compute(rid, request.all_token_ids, end - count, end)
            sampled_ids.append(
                [] if request.is_prefill_chunk else [sampled(rid, request.num_tokens, read_back)]
            )
        runner_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled_ids,
        )
        start = time.perf_counter()
        cpu_start = time.process_time()
        engine_outputs = scheduler.update_from_output(out, runner_output)
        times.append(wall + time.perf_counter() - start)
        cpu_times.append(cpu + time.process_time() - cpu_start)
        preemptions += len(out.preempted_req_ids)
        for outputs in engine_outputs.values():
            for item in outputs.outputs:
                tokens.setdefault(item.request_id, []).extend(item.new_token_ids)
            stats = outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                hits += stats.prefix_cache_stats.hits
                queries += stats.prefix_cache_stats.queries
    return {
        "times": times,
        "cpu_times": cpu_times,
        "hits": hits,
        "queries": queries,
        "preemptions": preemptions,
        "tokens": tokens,
        "bad_reads": oracle.bad_reads,
        "manager": type(scheduler.kv_cache_manager).__name__,
    }


def vllm_config_for(
    model: str,
    folder: Path,
    *,
    blocks: int,
    window: int = 256,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    **engine_options: Any,
) -> Any:
    """A real ``VllmConfig`` for the shrunk ``model`` (its config written into ``folder``),
    synchronous scheduling, prefix caching on, ``blocks`` KV blocks; ``engine_options`` go
    to ``EngineArgs`` (the tests build refused configurations with them)."""
    from vllm.engine.arg_utils import EngineArgs

    write_config(model, folder, window)
    options: dict[str, Any] = {
        "model": str(folder),
        "skip_tokenizer_init": True,
        "block_size": BLOCK_SIZE,
        "max_model_len": max_model_len,
        "enable_prefix_caching": True,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "async_scheduling": False,
        "dtype": "float32",
        "load_format": "dummy",
    }
    options.update(engine_options)
    config = EngineArgs(**options).create_engine_config()
    config.cache_config.num_gpu_blocks = blocks
    return config


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Both managers on the same workload, alternately; the figures per manager."""
    prompts = workload(args.requests, args.families, args.shared)
    results: dict[str, Any] = {"vllm": [], "kvspec": []}
    with tempfile.TemporaryDirectory() as folder:
        vllm_config = vllm_config_for(
            args.model,
            Path(folder),
            blocks=args.blocks,
            window=args.window,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        for _ in range(args.repeat):
            for name in ("vllm", "kvspec"):
                results[name].append(
                    run(vllm_config, prompts, args.blocks, args.output, name == "kvspec")
                )
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        times = [t for one in runs for t in one["times"]]
        summary[name] = {
            "manager": runs[0]["manager"],
            "steps": len(runs[0]["times"]),
            "median_us": statistics.median(times) * 1e6,
            "p90_us": percentile(times, 0.9) * 1e6,
            "total_s": sum(times) / len(runs),
            "cpu_s": statistics.median(sum(one["cpu_times"]) for one in runs),
            "cpu_median_us": statistics.median(t for one in runs for t in one["cpu_times"]) * 1e6,
            "cpu_p90_us": percentile([t for one in runs for t in one["cpu_times"]], 0.9) * 1e6,
            "hit_tokens": runs[0]["hits"],
            "query_tokens": runs[0]["queries"],
            "preemptions": runs[0]["preemptions"],
            "bad_reads": sum(one["bad_reads"] for one in runs),
        }
    # The tokens depend on the K/V each query read back: equal only if neither manager
    # made the runner read a wrong block (the bad reads say which one did).
    summary["same_tokens"] = all(
        one["tokens"] == results["vllm"][0]["tokens"] for runs in results.values() for one in runs
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--shared", type=int, default=512, help="system prompt tokens")
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256, help="sliding window (tokens)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    summary = compare(args)
    print(
        f"{args.model}: {args.requests} requests ({args.families} system prompts of "
        f"{args.shared} tokens, suffixes 64-191, {args.output} output tokens), {args.blocks} "
        f"blocks of {BLOCK_SIZE}; {args.repeat} runs each, schedule()+update_from_output() per step"
    )
    for name in ("vllm", "kvspec"):
        row = summary[name]
        print(
            f"  {name:6s} ({row['manager']}): {row['steps']} steps; per step CPU median "
            f"{row['cpu_median_us']:.0f} us, p90 {row['cpu_p90_us']:.0f} us (wall median "
            f"{row['median_us']:.0f}, p90 {row['p90_us']:.0f}); per run CPU "
            f"{row['cpu_s'] * 1e3:.0f} ms (wall {row['total_s'] * 1e3:.0f}); "
            f"hits {row['hit_tokens']} of {row['query_tokens']} tokens, "
            f"{row['preemptions']} preemptions; {row['bad_reads']} bad K/V reads"
        )
    print(f"  same tokens (sampled from the K/V read back): {summary['same_tokens']}")
    ok = summary["same_tokens"] and not summary["kvspec"]["bad_reads"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
