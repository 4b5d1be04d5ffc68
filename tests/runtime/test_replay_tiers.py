"""``benchmarks/replay_trace.py``: offload tiers (``--host-blocks`` / ``--disk-blocks``,
transfers confirmed at once) and chunked prefill (``--hybrid`` on long prompts)."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest
from runtime_testkit import REPLAY_TRACE_SCRIPT as SCRIPT
from runtime_testkit import load_replay_trace

from kvspec_core.runtime import chat_trace


@pytest.fixture(scope="module")
def replay_trace() -> ModuleType:
    return load_replay_trace("replay_trace_under_test")


@pytest.fixture(scope="module")
def chat_events() -> list[tuple]:
    return list(chat_trace.make_trace(seed=0, num_requests=100))


def test_a_host_tier_adds_hits_and_counts_them_by_tier(
    replay_trace: ModuleType, chat_events: list[tuple]
) -> None:
    alone = replay_trace.replay(chat_events, replay_trace.build_allocator(300))
    tiered = replay_trace.replay(chat_events, replay_trace.build_allocator(300, host_blocks=4000))
    assert alone["hit_tokens_by_tier"] == {"device": alone["hit_tokens"]}
    assert alone["blocks_moved"] == {}
    by_tier = tiered["hit_tokens_by_tier"]
    assert list(by_tier) == ["device", "host"] and by_tier["host"] > 0
    assert sum(by_tier.values()) == tiered["hit_tokens"] > alone["hit_tokens"]
    moved = tiered["blocks_moved"]
    assert set(moved) == {"device->host", "host->device"}
    assert moved["host->device"] * 16 >= by_tier["host"]  # each host hit token was loaded


def test_a_disk_tier_takes_the_host_tiers_evictions(
    replay_trace: ModuleType, chat_events: list[tuple]
) -> None:
    allocator = replay_trace.build_allocator(300, host_blocks=100, disk_blocks=4000)
    figures = replay_trace.replay(chat_events, allocator)
    assert list(figures["hit_tokens_by_tier"]) == ["device", "host", "disk"]
    assert sum(figures["hit_tokens_by_tier"].values()) == figures["hit_tokens"]
    assert figures["blocks_moved"]["host->disk"] > 0
    assert figures["hit_tokens_by_tier"]["disk"] > 0
    allocator.check_invariants()


def test_hybrid_prefills_a_long_prompt_in_chunks(replay_trace: ModuleType) -> None:
    # 30,000 prompt tokens: over the sliding-window group's cap for one step (its window
    # + 16,384 in-flight tokens).
    events = [("admit", 0, list(range(30_000))), ("finish", 0)]

    def prompt_and_waits(prefill_chunk: int | None) -> tuple[int, int]:
        allocator = replay_trace.build_allocator(
            4096, "hybrid", max_model_len=replay_trace.MOONCAKE_MAX_MODEL_LEN
        )
        figures = replay_trace.replay(events, allocator, prefill_chunk=prefill_chunk)
        return figures["prompt_tokens"], figures["waits"]

    assert prompt_and_waits(None) == (30_000, 1)  # one step cannot admit it: it waits
    assert prompt_and_waits(16_384) == (30_000, 0)


def test_disk_blocks_without_host_blocks_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--trace", "chat", "--requests", "2", "--disk-blocks", "9"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "--disk-blocks needs --host-blocks" in result.stderr
