"""``kvspec plan --host-memory / --disk / --disk-size``: the offload tiers in the table and JSON."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_cli_testkit import fails, plan_json

from kvspec_core.cli.main import main


def test_json_lists_each_tier_per_pool(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = plan_json(
        capsys,
        "jamba-1.5-mini",
        "--memory",
        "40GiB",
        "--host-memory",
        "256GiB",
        "--disk",
        str(tmp_path),
        "--disk-size",
        "2TiB",
    )
    host, disk = report["tiers"]
    assert (host["name"], host["path"], host["budget_bytes"]) == ("host", None, 256 << 30)
    assert (disk["name"], disk["path"], disk["budget_bytes"]) == ("disk", str(tmp_path), 2 << 40)
    assert [pool["num_blocks"] for pool in host["pools"]] == [894, 1044329]
    # The Mamba pool holds states, not tokens; attention's usable blocks x 16 tokens.
    assert [pool["tokens"] for pool in host["pools"]] == [None, 1044328 * 16]
    for tier in (host, disk):
        used = sum(
            pool["num_blocks"] * device["block_bytes"]
            for pool, device in zip(tier["pools"], report["pools"], strict=True)
        )
        assert tier["bytes_allocated"] == used <= tier["budget_bytes"]
        assert tier["num_blocks"] == sum(pool["num_blocks"] for pool in tier["pools"])
        assert tier["max_concurrency"] == min(
            (pool["num_blocks"] - 1) / device["blocks_per_request"]
            for pool, device in zip(tier["pools"], report["pools"], strict=True)
        )


def test_no_tier_options_means_no_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")
    assert report["tiers"] == []
    assert main(["plan", "llama-3.1-8b", "--memory", "40GiB"]) == 0
    assert "tier" not in capsys.readouterr().out


def test_table_shows_blocks_and_tokens_per_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama-3.1-8b", "--memory", "40GiB", "--host-memory", "256GiB"]) == 0
    out = capsys.readouterr().out
    assert "host  0     131,072  2,097,136  256.00 GiB" in out
    assert "host tier        131,072 blocks, 256.00 GiB of 256.00 GiB; 16.00 requests" in out


def test_pipeline_stages_each_get_the_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(
        capsys, "llama-3.1-70b", "--memory", "40GiB", "--pp", "2", "--host-memory", "100GiB"
    )
    assert report["tiers"][0]["pools"][0]["num_blocks"] == (100 << 30) // 2621440


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--disk-size", "1TiB"], "--disk-size needs --disk PATH"),
        (["--disk", "/tmp"], "--disk needs --disk-size SIZE"),
        (["--host-memory=-1GiB"], "--host-memory '-1GiB' is negative"),
        (["--host-memory", "0"], "--host-memory '0'"),
        (["--disk", "/tmp", "--disk-size", "lots"], "--disk-size 'lots' is not a size"),
        (["--host-memory", "1MiB"], "--host-memory 1.00 MiB is too small for the host"),
        (["--disk", "/tmp", "--disk-size", "1MiB"], "--disk-size 1.00 MiB is too small"),
    ],
)
def test_bad_tier_options_name_the_option(
    capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    error = fails(capsys, "jamba-1.5-mini", "--memory", "40GiB", *arguments)
    assert message in error


def test_disk_must_be_a_writable_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    file = tmp_path / "file"
    file.write_text("")
    for path in (file, tmp_path / "missing"):
        error = fails(
            capsys, "llama-3.1-8b", "--memory", "40GiB", "--disk", str(path), "--disk-size", "1TiB"
        )
        assert f"--disk '{path}' must be an existing directory" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made


def test_too_small_tier_names_the_least_size_that_works(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = fails(capsys, "jamba-1.5-mini", "--memory", "40GiB", "--host-memory", "1MiB")
    assert "pass --host-memory 3014656 or more" in error
    report = plan_json(capsys, "jamba-1.5-mini", "--memory", "40GiB", "--host-memory", "3014656")
    assert [pool["num_blocks"] for pool in report["tiers"][0]["pools"]] == [2, 2]


def test_tiers_are_refused_for_a_model_that_caches_no_prefix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Whisper's cross-attention holds the encoder's K/V, which no prompt prefix names: no
    prefix of it is cached, so a host tier would stay empty (planned silently before)."""
    err = fails(capsys, "whisper-large-v3", "--memory", "40GiB", "--host-memory", "64GiB")
    assert "(cross_attention) caches no prefix" in err and "--host-memory" in err
