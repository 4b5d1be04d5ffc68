"""``benchmarks/replay_trace.py --eviction / --write-through / --family-keep``: the
eviction order reaches the device and every tier, the host tier's write and keep policies
reach the allocator, and the flags need a host tier."""

from __future__ import annotations

import json
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
from runtime_testkit import REPLAY_TRACE_SCRIPT as SCRIPT
from runtime_testkit import load_replay_trace

from kvspec_core.runtime import chat_trace
from kvspec_core.runtime.tiers import KEEP_EVERYTHING, KEEP_FAMILY_RULES, WRITE_BACK, WRITE_THROUGH


@pytest.fixture(scope="module")
def replay_trace() -> ModuleType:
    return load_replay_trace("replay_trace_options_under_test")


def test_eviction_applies_to_the_device_and_every_tier(replay_trace: ModuleType) -> None:
    allocator = replay_trace.build_allocator(
        300, eviction="segmented", host_blocks=100, disk_blocks=400
    )
    assert allocator.pools[0].eviction == "segmented"
    assert [tier.eviction for tier in allocator._tiers.tiers] == ["segmented", "segmented"]
    assert [row[0].eviction for row in allocator._tiers.tier_pools] == ["segmented"] * 2


def test_write_through_and_family_keep_reach_the_host_tier(replay_trace: ModuleType) -> None:
    events = list(chat_trace.make_trace(seed=0, num_requests=60))
    back = replay_trace.build_allocator(300, "hybrid", host_blocks=4000)
    through = replay_trace.build_allocator(
        300, "hybrid", host_blocks=4000, write_policy=WRITE_THROUGH, keep=KEEP_FAMILY_RULES
    )
    (host,) = through._tiers.tiers
    assert (host.write_policy, host.keep) == (WRITE_THROUGH, KEEP_FAMILY_RULES)
    assert (back._tiers.tiers[0].write_policy, back._tiers.tiers[0].keep) == (
        WRITE_BACK,
        KEEP_EVERYTHING,
    )
    assert list(through._tiers._keep_rules) == [1]  # the sliding-window group
    figures = replay_trace.replay(events, through)
    assert figures["blocks_moved"]["device->host"] > 0
    assert sum(figures["hit_tokens_by_tier"].values()) == figures["hit_tokens"]
    through.check_invariants()


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--trace", "chat", "--requests", "20", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_json_says_the_host_tiers_policies() -> None:
    result = run_script("--host-blocks", "500", "--write-through", "--json")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert (figures["write_policy"], figures["keep"]) == (WRITE_THROUGH, KEEP_EVERYTHING)


@pytest.mark.parametrize("flag", ["--write-through", "--family-keep"])
def test_the_flags_need_a_host_tier(flag: str) -> None:
    result = run_script(flag)
    assert result.returncode == 2
    assert f"{flag} is the host tier's" in result.stderr and "--host-blocks" in result.stderr


def test_an_engines_own_prefill_split_drives_the_steps(replay_trace: ModuleType) -> None:
    events = list(chat_trace.make_trace(seed=0, num_requests=60))
    chunked = replay_trace.replay(events, replay_trace.build_allocator(2000), prefill_chunk=48)
    asked: list[int] = []

    def split(request: object, prefix: object, running: int) -> list[int]:
        asked.append(running)
        tokens = len(request.token_ids)  # type: ignore[attr-defined]
        return replay_trace.prefill_steps(prefix.num_tokens, tokens, None, 48)  # type: ignore[attr-defined]

    allocator = replay_trace.build_allocator(2000)
    split_by_hook = replay_trace.replay(events, allocator, prefill_split=split)
    # The same 48-token steps from the hook as from prefill_chunk: the same replay.
    for key in ("hit_tokens", "prefill_steps", "waits", "peak_blocks", "decode_stalls"):
        assert split_by_hook[key] == chunked[key], key
    assert chunked["prefill_steps"] > len(asked) // 2 > 0
    assert max(asked) > 0  # told how many others run

    # An empty split leaves the request waiting: nothing is admitted.
    idle = replay_trace.replay(
        events, replay_trace.build_allocator(2000), prefill_split=lambda *_: []
    )
    assert idle["prefill_steps"] == idle["hit_tokens"] == 0
    assert idle["waits"] > 0


def test_an_engines_split_takes_each_steps_transfers_before_the_next(
    replay_trace: ModuleType,
) -> None:
    events = list(chat_trace.make_trace(seed=0, num_requests=60))
    allocator = replay_trace.build_allocator(300, host_blocks=3000)
    # The admission in progress and how many of its steps are still to allocate.
    admitting: dict[str, Any] = {"request": None, "left": 0}
    between_steps: list[int] = []

    def split(request: Any, prefix: Any, running: int) -> list[int]:
        steps = replay_trace.prefill_steps(prefix.num_tokens, len(request.token_ids), None, 32)
        admitting.update(request=request, left=len(steps))
        return steps

    allocate_slots, take = allocator.allocate_slots, allocator.take_transfers

    def allocate_and_count(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = allocate_slots(request, *args, **kwargs)
        if request is admitting["request"]:
            admitting["left"] -= 1
            if not result or not admitting["left"]:
                admitting["request"] = None
        return result

    def take_and_note(*args: Any) -> list:
        transfers = take(*args)
        if admitting["request"] is not None:
            between_steps.append(len(transfers))
        return transfers

    allocator.allocate_slots = allocate_and_count
    allocator.take_transfers = take_and_note
    figures = replay_trace.replay(events, allocator, prefill_split=split)
    assert figures["blocks_moved"]["device->host"] > 0
    # Taken between a prompt's steps (each step's copies before its forward), and some of
    # those takes carried copies.
    assert len(between_steps) > figures["prefill_steps"] // 4
    assert sum(between_steps) > 0
    allocator.check_invariants()
