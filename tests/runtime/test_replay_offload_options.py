"""``benchmarks/replay_trace.py --eviction / --write-through / --family-keep``: the
eviction order reaches the device and every tier, the host tier's write and keep policies
reach the allocator, and the flags need a host tier."""

from __future__ import annotations

import json
import subprocess
import sys
from types import ModuleType

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
