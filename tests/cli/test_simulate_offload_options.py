"""``kvspec simulate --offload write-back|write-through`` and ``--eviction``: the first
tier's write policy and the eviction order of the device pools and of every offload tier
reach the allocator the replay runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec_core.cli import simulate_replay
from kvspec_core.cli.main import main
from kvspec_core.runtime.tiers import WRITE_BACK, WRITE_THROUGH

TIGHT = ("llama-3.1-8b", "--memory", "2GiB", "--max-model-len", "8192", "--trace", "chat")


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list:
    """The allocators the replays ran on."""
    seen: list = []
    replay = simulate_replay.simulate

    def spy(allocator, *args, **kwargs):
        seen.append(allocator)
        return replay(allocator, *args, **kwargs)

    monkeypatch.setattr(simulate_replay, "simulate", spy)
    return seen


def simulate(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main(["simulate", *TIGHT, "--requests", "120", *args, "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_write_through_reaches_the_first_tier(
    capsys: pytest.CaptureFixture[str], built: list
) -> None:
    back = simulate(capsys, "--host-memory", "4GiB")
    through = simulate(capsys, "--host-memory", "4GiB", "--offload", "write-through")
    assert (back["offload"], through["offload"]) == (WRITE_BACK, WRITE_THROUGH)
    assert [a._tiers.tiers[0].write_policy for a in built] == [WRITE_BACK, WRITE_THROUGH]
    host_back, host_through = back["tiers"][1], through["tiers"][1]
    assert host_through["hit_tokens"] > 0 and host_through["loaded_blocks"] > 0
    # Copies made as blocks are cached, not as they are evicted: another count of stores.
    assert host_through["stored_blocks"] != host_back["stored_blocks"]
    assert sum(through["hit_tokens_by_tier"].values()) == through["hit_tokens"]


def test_eviction_applies_to_the_device_and_every_tier(
    capsys: pytest.CaptureFixture[str], built: list, tmp_path: Path
) -> None:
    report = simulate(
        capsys,
        "--host-memory",
        "1GiB",
        "--disk",
        str(tmp_path),
        "--disk-size",
        "2GiB",
        "--eviction",
        "segmented",
    )
    assert report["eviction"] == "segmented"
    (allocator,) = built
    assert {pool.eviction for pool in allocator.pools} == {"segmented"}
    assert [tier.eviction for tier in allocator._tiers.tiers] == ["segmented", "segmented"]
    assert {
        slots.eviction for row in allocator._tiers.tier_pools for slots in row if slots is not None
    } == {"segmented"}
    assert simulate(capsys)["eviction"] == "lru"
    assert built[-1].pools[0].eviction == "lru"


def test_offload_without_a_tier_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", *TIGHT, "--offload", "write-through", "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0
    assert "--offload write-through" in err and "--host-memory" in err
