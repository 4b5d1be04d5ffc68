"""``kvspec simulate --host-memory / --disk / --disk-size / --plot``: offload tiers in the
simulator (every transfer confirmed at once), the per-tier figures and the host sweep."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvspec_core.cli import simulate_replay
from kvspec_core.cli.main import main

#: llama-3.1-8b at 2 GiB: 1,024 device blocks of 2 MiB (16 tokens), too few for the chat
#: trace's conversations, so evicted prefixes come back.
TIGHT = ("llama-3.1-8b", "--memory", "2GiB", "--max-model-len", "8192", "--trace", "chat")
BLOCK_BYTES = 2 * 1024 * 1024


def simulate(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main(["simulate", *TIGHT, "--requests", "120", *args, "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_a_host_tier_gets_more_hits_and_its_figures_add_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    alone = simulate(capsys)
    tiered = simulate(capsys, "--host-memory", "4GiB")
    assert alone["hit_tokens_by_tier"] == {"device": alone["hit_tokens"]}
    assert tiered["tier_blocks"] == {"host": 2048}
    assert tiered["hit_tokens"] > alone["hit_tokens"]
    by_tier = tiered["hit_tokens_by_tier"]
    assert list(by_tier) == ["device", "host"] and by_tier["host"] > 0
    assert sum(by_tier.values()) == tiered["hit_tokens"]
    device, host = tiered["tiers"]
    assert [device["name"], host["name"]] == ["device", "host"]
    assert by_tier == {"device": device["hit_tokens"], "host": host["hit_tokens"]}
    # The device only loads and offloads; the host is stored into and loaded from.
    assert device["loaded_blocks"] == device["stored_blocks"] == device["load_waits"] == 0
    assert host["stored_blocks"] > 0 and host["loaded_blocks"] > 0 and host["load_waits"] > 0
    assert host["demoted_blocks"] == 0  # nothing below the host tier
    for tier in tiered["tiers"]:
        for kind in ("loaded", "stored", "demoted"):
            assert tier[f"{kind}_bytes"] == tier[f"{kind}_blocks"] * BLOCK_BYTES
    # A hit token from the host needs its block loaded: at least hit/16 blocks came back.
    assert host["loaded_blocks"] * 16 >= host["hit_tokens"]


def test_a_disk_tier_below_the_host_takes_its_evictions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = simulate(
        capsys, "--host-memory", "1GiB", "--disk", str(tmp_path), "--disk-size", "4GiB"
    )
    _, host, disk = report["tiers"]
    assert report["tier_blocks"] == {"host": 512, "disk": 2048}
    assert host["demoted_blocks"] == disk["stored_blocks"] > 0
    assert sum(report["hit_tokens_by_tier"].values()) == report["hit_tokens"]
    assert not list(tmp_path.iterdir())  # the simulator writes no block files


def test_the_table_shows_one_row_per_tier(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", *TIGHT, "--requests", "60", "--host-memory", "4GiB", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("device ", "host "))]
    assert rows == ["device", "host"]
    assert "loaded to device" in out and "load waits" in out


def test_plot_sweeps_host_memory_and_writes_a_png(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(simulate_replay, "PLOT_HOST_MULTIPLES", (0.0, 2.0))
    target = tmp_path / "hosts.png"
    report = simulate(capsys, "--requests", "60", "--plot", str(target))
    assert target.read_bytes().startswith(b"\x89PNG")
    sweep = report["host_memory_sweep"]
    assert [point["host_memory_bytes"] for point in sweep] == [0, 4 << 30]
    assert sweep[0]["host_blocks"] == 0 and sweep[1]["host_blocks"] == 2048
    assert sweep[0]["hit_tokens"] == report["hit_tokens"]  # the run itself has no host tier
    assert sweep[1]["hit_tokens"] > sweep[0]["hit_tokens"]


def test_a_budget_too_small_for_the_plot_sweep_is_refused_naming_plot_before_replaying(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Found in review: the sweep's 0.25x host tier held no block, and the error blamed
    --host-memory (which the sweep replaces), after the first replays had run."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "hosts.png"
    code = main(
        ["simulate", "llama-3.1-8b", "--memory", "12MiB", "--max-model-len", "48"]
        + ["--requests", "5", "--no-progress", "--plot", str(target)]
    )
    assert code == 2
    captured = capsys.readouterr()
    assert "--plot replays host tiers" in captured.err and "--host-memory" not in captured.err
    assert "pass --memory 16777216 or more" in captured.err
    assert "replaying" not in captured.err and not target.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--host-memory", "lots"), "--host-memory"),
        (("--host-memory", "1KiB"), "--host-memory .* is too small for the host offload tier"),
        (("--disk-size", "1GiB"), "--disk-size needs --disk"),
        (("--disk", "/nonexistent-kvspec-dir", "--disk-size", "1GiB"), "--disk"),
        (("--disk", "."), "--disk needs --disk-size"),
    ],
)
def test_bad_tier_options_are_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code = main(["simulate", *TIGHT, "--requests", "5", *args, "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0
    assert re.search(message, err), err
