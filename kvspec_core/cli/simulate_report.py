"""The ``kvspec simulate --json`` document (the human output is rendered from it,
:mod:`kvspec_core.cli.simulate_text`).

Keys: ``model``, ``kv_budget_bytes``, ``max_model_len``, ``block_size``, ``trace``,
``seed`` (null for a file), ``skipped_too_long``, ``eviction``, ``offload``
(``write_back`` / ``write_through``; null without tiers), ``groups`` (kinds),
``num_blocks`` (device, all pools), ``tier_blocks`` (offload tier name -> its blocks, all
pools; empty without tiers), the replay's figures (``events``, ``requests``, ``admitted``,
``never_admitted``, ``readmissions``, ``prompt_tokens``, ``hit_tokens``,
``readmission_hit_tokens`` (of ``hit_tokens``, those of re-admissions after preemption),
``prefix_hit_rate``, ``waited_admissions``, ``wait_retries``, ``rejected``,
``preemptions``, ``dropped_decodes`` (the trace's decodes of requests then queued: an
engine generates nothing for them), ``checkpoint_splits``, ``truncated``, ``peak_used_blocks``,
``usable_blocks``, ``peak_usage``, ``peak_used_blocks_by_pool`` and
``usable_blocks_by_pool``: each pool's own peak and blocks, in plan order,
``longest_request_tokens``: the most tokens a request held, prompt and output),
``hit_tokens_by_tier`` (tier name -> hit tokens served
from it, the device first; they add up to ``hit_tokens``), ``tiers`` (one object per tier,
the device first: ``name``, ``hit_tokens``, ``load_waits`` (admissions whose forward waited
for a load from it), ``loaded_blocks`` / ``loaded_bytes`` (copied to the device),
``stored_blocks`` / ``stored_bytes`` (copied into it), ``demoted_blocks`` /
``demoted_bytes`` (copied from it to the next tier down); bytes are blocks x the pool's
block bytes), ``seconds`` (the replay's wall time); with ``--plot``, ``plot`` (the file) and
``host_memory_sweep`` (per replay: ``host_memory_bytes``, ``host_blocks``, ``hit_tokens``,
``prefix_hit_rate``).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvspec_core.cli.simulate_replay import Replay, write_policy
from kvspec_core.cli.simulate_trace import TraceReplay


def simulate_report(
    model: str,
    budget: int,
    args: argparse.Namespace,
    trace: TraceReplay,
    replay: Replay,
    sweep: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The document of ``replay`` (``model`` planned within ``budget`` bytes) of ``trace``,
    and of ``--plot``'s ``sweep`` when there is one."""
    plan = replay.planned.plan
    document = {
        "model": model,
        "kv_budget_bytes": budget,
        "max_model_len": replay.planned.context.max_model_len,
        "block_size": args.block_size,
        "trace": args.trace,
        "seed": trace.seed,
        "skipped_too_long": trace.skipped,
        "eviction": args.eviction,
        "offload": write_policy(args) if plan.tiers else None,
        "groups": [group.kind for group in plan.groups],
        "num_blocks": plan.num_blocks,
        "tier_blocks": {tier.name: sum(tier.blocks_per_pool) for tier in plan.tiers},
        **replay.report.to_dict(),
        "seconds": replay.seconds,
    }
    if sweep is not None:
        document["plot"] = args.plot
        document["host_memory_sweep"] = sweep
    return document
