"""Lockstep against vLLM 0.33: the same trace through kvspec's allocator and vLLM's
KVCacheManager event by event, kvspec's prefills ending where vLLM's scheduler ends them,
every admission's hit compared, and every hit on either side checked against what the
trace computed before it.

``vs_vllm.py`` compares throughput and total hit tokens, each side chunking prefills its own
way; for the Mamba hybrid (``--mamba``) that alone makes the totals differ (vLLM ends a
prefill step at every token-budget boundary and keeps, at its default retention, only some of
the states; kvspec's replay ends steps only at ``checkpoint_at`` and the prompt's end). Here
kvspec is driven with vLLM's very step ends, so on a pool that never evicts the two sides must
give the same hit for every admission; where they do not, the first few differing admissions
are printed with how many of the blocks kvspec's hit uses, per group, vLLM's cache lacked
(a hit the other side's eviction order kept is a legitimate difference; a hit neither side's
history backs is a bug).

The check that needs no second engine: a hit of ``H`` tokens is backed when an earlier step
of the same side (a prefill step or a decode; a side's steps start at its own hit) computed
those very ``H`` tokens, and, for a model with a state group (Mamba), ended exactly at ``H``
(a state exists only where a step ended, or where a decode crossed a block boundary).
``unbacked_hits`` counts hits that fail it, per side; it must be 0. It cannot see a block
evicted and handed out since (``tier_content_check.py`` checks content).

vLLM is driven as ``vs_vllm.py`` drives it (``replay_vllm``): ``get_computed_blocks``, then,
for ``--mamba``, chunks of at most ``--vllm-max-num-batched-tokens`` less one token per
running request, clipped by the scheduler's own ``_mamba_block_aligned_split``, one engine
step each (``new_step_starts``); other models prefill in one step, but ``--hybrid`` on
Mooncake in chunks of ``max_in_flight_tokens``, as ``replay_trace.py --hybrid`` does. The
scheduling is vLLM's: an admission vLLM refuses stays waiting on both sides
(``refused_by_vllm``). The lockstep stops, and says why, where the sides stop running the
same steps (kvspec refuses what vLLM admits, one side stalls a decode); the figures are then
those up to that event. Needs vLLM
0.33 (``.venv-vllm``, see the README's Benchmarks section)::

    .venv-vllm/bin/python benchmarks/vs_vllm_lockstep.py [--trace shared|chat|mooncake[:FILE]]
        [--hybrid | --mamba] [--blocks 32768] [--requests N]
        [--vllm-retention-interval dense|0|N] [--vllm-max-num-batched-tokens 8192] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Callable
from typing import Any

from replay_trace import (
    BLOCK_SIZE,
    build_allocator,
    load_trace,
    model_name,
    prefix_chain,
)
from vs_vllm import (
    MAX_NUM_BATCHED_TOKENS,
    _import_vllm,
    _retention_interval,
    build_vllm_manager,
    mamba_align_split,
)

from kvspec_core.runtime.request import Request

#: Differing admissions printed in full.
SHOWN_DIFFERENCES = 5


class History:
    """What the trace's steps computed: per request, the chained hash of each block-aligned
    prefix it computed; all of them (an attention hit may end at any), and those at which a
    step ended (a state hit may end only there)."""

    def __init__(self) -> None:
        self.chains: dict[int, list[int]] = {}
        self.computed: set[tuple[int, int]] = set()
        self.step_ends: set[tuple[int, int]] = set()

    def _chain(self, rid: int, tokens: list[int], upto: int) -> list[int]:
        return prefix_chain(self.chains.setdefault(rid, []), tokens, upto)

    def ran(self, rid: int, tokens: list[int], start: int, end: int) -> None:
        """A step of ``rid`` computed tokens ``[start, end)``."""
        chain = self._chain(rid, tokens, end)
        for block in range(start // BLOCK_SIZE, end // BLOCK_SIZE):
            self.computed.add(((block + 1) * BLOCK_SIZE, chain[block]))
        if end % BLOCK_SIZE == 0 and end:
            self.step_ends.add((end, chain[end // BLOCK_SIZE - 1]))

    def backs(self, rid: int, tokens: list[int], hit: int, needs_state: bool) -> bool:
        """Whether an earlier step computed ``tokens[:hit]`` (and ended at ``hit``)."""
        if hit == 0:
            return True
        key = (hit, self._chain(rid, tokens, hit)[hit // BLOCK_SIZE - 1])
        return key in self.step_ends if needs_state else key in self.computed

    def forget(self, rid: int) -> None:
        self.chains.pop(rid, None)


class Diverged(Exception):
    """The two sides stopped running the same steps."""


def lockstep(
    events: list[tuple],
    model: str,
    blocks: int,
    max_model_len: int,
    retention: int | None,
    budget: int,
    hash_algo: str = "sha256",
    prefill_chunk: int | None = None,
) -> dict[str, Any]:
    """Run both sides on ``events`` (module docstring); their figures. ``prefill_chunk``
    (models without a state group): prefill in steps of at most that many tokens."""
    from vllm import SamplingParams
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.request import RequestStatus

    manager, hasher = build_vllm_manager(blocks, model, hash_algo, retention, max_model_len)
    allocator = build_allocator(blocks, model, max_model_len=max_model_len)
    mamba = model == "mamba_hybrid"
    if mamba:
        split: Callable[..., int] = mamba_align_split(manager, budget)
    else:
        chunk = prefill_chunk or max_model_len

        def split(request: Any, num_new: int, *_: int) -> int:
            return min(num_new, chunk)

    sampling = SamplingParams(max_tokens=max_model_len)
    pool = manager.block_pool
    # Each side's own steps back its own hits (kvspec runs from its hit, which may differ).
    histories = {"vllm": History(), "kvspec": History()}
    running: dict[int, tuple[Any, Request]] = {}
    waiting: collections.OrderedDict[int, tuple[Any, Request]] = collections.OrderedDict()
    figures: dict[str, Any] = {
        "admissions": 0,
        "hit_tokens": {"vllm": 0, "kvspec": 0},
        "longer_for_kvspec": {"admissions": 0, "tokens": 0},
        "longer_for_vllm": {"admissions": 0, "tokens": 0},
        "unbacked_hits": {"vllm": 0, "kvspec": 0},
        "refused_by_vllm": 0,
        "differences": [],
        "stopped": None,
    }

    def vllm_steps(rid: int, request: Any, blocks_hit: Any, hit: int) -> list[int]:
        """vLLM's prefill steps past ``hit``, allocated: their ends; only the first one's
        when vLLM refuses the admission (it then stays waiting)."""
        room = budget - len(running) if mamba else max_model_len
        first = split(request, min(request.num_tokens - hit, room), hit, 0)
        if (
            first == 0
            or manager.allocate_slots(
                request,
                first,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks_hit,
                full_sequence_must_fit=True,
                has_scheduled_reqs=bool(running),
            )
            is None
        ):
            return [hit + first]
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit + first
        ends = [request.num_computed_tokens]
        while request.num_computed_tokens < request.num_tokens:
            manager.new_step_starts()
            size = split(request, min(request.num_tokens - request.num_computed_tokens, room))
            if size == 0 or manager.allocate_slots(request, size) is None:
                raise Diverged(f"request {rid}: vLLM's scheduler would preempt it mid-prefill")
            request.num_computed_tokens += size
            ends.append(request.num_computed_tokens)
        return ends

    def admit(rid: int, vllm_request: Any, request: Request) -> bool:
        manager.new_step_starts()
        blocks_hit, vllm_hit, vllm_request.shared_prefix_boundary = manager.get_computed_blocks(
            vllm_request
        )
        prefix = allocator.find_cached_prefix(request)
        hit = prefix.num_tokens
        tokens = request.token_ids
        # Where kvspec's hit is longer: per group, how many of the blocks it uses vLLM's
        # cache lacked, read before this admission caches anything (same group order).
        missing = None
        if hit > vllm_hit:
            missing = [
                sum(
                    pool.get_cached_block(vllm_request.block_hashes[index], [group]) is None
                    for index, block in enumerate(blocks)
                    if block
                )
                for group, blocks in enumerate(prefix.block_ids)
            ]
        ends = vllm_steps(rid, vllm_request, blocks_hit, vllm_hit)
        if vllm_request.status != RequestStatus.RUNNING:
            # vLLM's scheduler keeps it waiting: kvspec, driven by that scheduler's
            # decisions, is not asked (its lookup changed nothing).
            figures["refused_by_vllm"] += 1
            return False
        # kvspec's steps end where vLLM's do past kvspec's own hit (a step from a shorter
        # hit than vLLM's is cut at the prefill chunk, which a window group needs).
        steps = [end for end in ends if end > hit]
        if not mamba and prefill_chunk is not None:
            steps = sorted({*steps, *range(hit + prefill_chunk, steps[0], prefill_chunk)})
        starts = [hit, *steps[:-1]]
        if not allocator.allocate_slots(request, steps[0] - hit, prefix=prefix):
            raise Diverged(f"request {rid}: vLLM admitted it, kvspec refuses")
        for start, end in zip(starts[1:], steps[1:], strict=True):
            if not allocator.allocate_slots(request, end - start):
                raise Diverged(f"request {rid}: kvspec refuses a prefill step vLLM ran")
        figures["admissions"] += 1
        for side, side_hit in (("vllm", vllm_hit), ("kvspec", hit)):
            figures["hit_tokens"][side] += side_hit
            if not histories[side].backs(rid, tokens, side_hit, mamba):
                figures["unbacked_hits"][side] += 1
        if hit != vllm_hit:
            longer = figures["longer_for_kvspec" if hit > vllm_hit else "longer_for_vllm"]
            longer["admissions"] += 1
            longer["tokens"] += abs(hit - vllm_hit)
            if len(figures["differences"]) < SHOWN_DIFFERENCES:
                figures["differences"].append(
                    {
                        "request": rid,
                        "prompt_tokens": len(tokens),
                        "vllm_hit": vllm_hit,
                        "kvspec_hit": hit,
                        "kvspec_checkpoint_at": prefix.checkpoint_at,
                        "vllm_lacked_of_kvspec_hit": missing,
                    }
                )
        for start, end in zip([vllm_hit, *ends[:-1]], ends, strict=True):
            histories["vllm"].ran(rid, tokens, start, end)
        for start, end in zip(starts, steps, strict=True):
            histories["kvspec"].ran(rid, tokens, start, end)
        running[rid] = (vllm_request, request)
        return True

    try:
        for event in events:
            kind = event[0]
            if kind == "decode":
                pair = running.get(event[1])
                if pair is None:
                    continue
                vllm_request, request = pair
                vllm_request.append_output_token_ids(event[2])
                request.token_ids.append(event[2])
                vllm_stalls = manager.allocate_slots(vllm_request, 1) is None
                kvspec_stalls = not allocator.allocate_slots(request, 1)
                if vllm_stalls != kvspec_stalls:
                    side = "vLLM" if vllm_stalls else "kvspec"
                    raise Diverged(f"request {event[1]}: only {side} stalls a decode")
                if vllm_stalls:
                    # Neither ran the step: the token is not computed (vs_vllm.py skips it).
                    raise Diverged(f"request {event[1]}: a decode stalls on both sides")
                vllm_request.num_computed_tokens += 1
                end = len(request.token_ids)
                for history in histories.values():
                    history.ran(event[1], request.token_ids, end - 1, end)
            elif kind == "admit":
                rid = event[1]
                pair = (
                    VllmRequest(str(rid), list(event[2]), sampling, None, block_hasher=hasher),
                    Request(rid, list(event[2])),
                )
                if waiting or not admit(rid, *pair):
                    waiting[rid] = pair
            else:
                rid = event[1]
                if waiting.pop(rid, None) is None:
                    vllm_request, _ = running.pop(rid)
                    manager.free(vllm_request)
                    allocator.free(rid)
                    for history in histories.values():
                        history.forget(rid)
                # The queue is retried after any finish, a queued one's too (replay_trace).
                while waiting:
                    head = next(iter(waiting))
                    if not admit(head, *waiting[head]):
                        break
                    del waiting[head]
    except Diverged as stop:
        figures["stopped"] = str(stop)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="chat", metavar="shared|chat|mooncake[:FILE]")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hybrid", action="store_true", help="sliding window 4096 + full")
    model.add_argument("--mamba", action="store_true", help="Mamba-1 (align) + full")
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--vllm-hash-algo", default="sha256")
    parser.add_argument(
        "--vllm-retention-interval",
        type=_retention_interval,
        default=None,
        help="--mamba: vLLM's prefix_cache_retention_interval (default 'dense', every "
        "state a step computed, as kvspec keeps them; 0 is vLLM's own default)",
    )
    parser.add_argument(
        "--vllm-max-num-batched-tokens",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help=f"--mamba: vLLM's token budget per step (default {MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.blocks < 2 or args.vllm_max_num_batched_tokens < BLOCK_SIZE:
        parser.error(f"--blocks must be >= 2, --vllm-max-num-batched-tokens >= {BLOCK_SIZE}")
    model = model_name(args)
    vllm = _import_vllm()
    try:
        events, requests, _, max_model_len, prefill_chunk = load_trace(
            args.trace, args.requests, args.hybrid
        )
    except ValueError as error:
        parser.error(str(error))
    figures = lockstep(
        events,
        model,
        args.blocks,
        max_model_len,
        args.vllm_retention_interval if args.mamba else None,
        args.vllm_max_num_batched_tokens,
        args.vllm_hash_algo,
        prefill_chunk,
    )
    header = {
        "trace": args.trace,
        "model": model,
        "blocks": args.blocks,
        "requests": requests,
        "events": len(events),
        "vllm_version": vllm.__version__,
    }
    if args.json:
        print(json.dumps({**header, **figures}))
        return
    print(
        f"{model} on {args.trace} ({requests:,} requests, {len(events):,} events), "
        f"{args.blocks:,} blocks, vLLM {vllm.__version__}, lockstep:"
    )
    hits = figures["hit_tokens"]
    print(
        f"  admissions {figures['admissions']:,}; hit tokens vLLM {hits['vllm']:,}, kvspec "
        f"{hits['kvspec']:,}; longer for kvspec in "
        f"{figures['longer_for_kvspec']['admissions']:,} admissions "
        f"(+{figures['longer_for_kvspec']['tokens']:,} tokens), for vLLM in "
        f"{figures['longer_for_vllm']['admissions']:,} "
        f"(+{figures['longer_for_vllm']['tokens']:,}); unbacked hits vLLM "
        f"{figures['unbacked_hits']['vllm']}, kvspec {figures['unbacked_hits']['kvspec']}; "
        f"admissions vLLM refused (both waited) {figures['refused_by_vllm']:,}"
    )
    for difference in figures["differences"]:
        print(f"  differs: {difference}")
    if figures["stopped"]:
        print(f"  stopped early: {figures['stopped']}")


if __name__ == "__main__":
    main()
