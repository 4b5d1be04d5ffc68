"""``kvspec plugins`` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAMILIES = {
    "mla": "kvspec-mla",
    "mamba": "kvspec-mamba",
    "sliding_window": "kvspec-sliding-window",
    "chunked_local": "kvspec-chunked-local",
    "hisparse": "kvspec-hisparse",
}


def run_cli(
    *args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVSPEC_")}
    environ.update(env or {})
    if pythonpath is not None:
        environ["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "kvspec_core", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )


@pytest.fixture
def broken_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "kvspec_broken.py").write_text("import not_a_module_anywhere\n")
    info = site / "kvspec_broken-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvspec-broken\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[kvspec.plugins]\nbroken = kvspec_broken\n")
    return site


def test_json_lists_the_five_families_with_distribution_and_version() -> None:
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {p["name"]: p for p in report["plugins"]}
    assert set(FAMILIES) <= set(by_name)
    for name, distribution in FAMILIES.items():
        entry = by_name[name]
        assert entry["distribution"] == distribution
        assert entry["version"] == "0.1.0"
        assert set(entry) >= {"name", "distribution", "version", "spec_kinds", "hooks"}
    assert report["failed"] == []
    assert "full_attention" in report["core"]["spec_kinds"]
    # Each dtype under its owner (found in review: the core listed the plugins' too).
    assert "fp8_ds_mla" in by_name["mla"]["kv_cache_dtypes"]
    assert "fp8_ds_mla" not in report["core"]["kv_cache_dtypes"]
    assert "fp8" in report["core"]["kv_cache_dtypes"]


def test_allow_list_loads_only_mla() -> None:
    result = run_cli("plugins", "--json", env={"KVSPEC_PLUGINS": "mla"})
    assert result.returncode == 0, result.stderr
    assert [p["name"] for p in json.loads(result.stdout)["plugins"]] == ["mla"]


def test_broken_distribution_is_reported_and_others_still_load(broken_site: Path) -> None:
    result = run_cli("plugins", "--json", pythonpath=broken_site)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(FAMILIES) <= {p["name"] for p in report["plugins"]}
    [failure] = report["failed"]
    assert failure["name"] == "broken" and failure["distribution"] == "kvspec-broken"
    assert "not_a_module_anywhere" in failure["error"]
    assert "kvspec: warning: kvspec plugin 'broken'" in result.stderr
    human = run_cli("plugins", pythonpath=broken_site)
    assert "FAILED broken (kvspec-broken)" in human.stdout


def test_strict_mode_exits_non_zero_naming_the_broken_plugin(broken_site: Path) -> None:
    result = run_cli(
        "plugins", "--json", env={"KVSPEC_STRICT_PLUGINS": "1"}, pythonpath=broken_site
    )
    assert result.returncode == 2
    assert "'broken'" in result.stderr and "kvspec-broken" in result.stderr
    assert "Traceback" not in result.stderr


def test_human_table_lists_core_and_plugins() -> None:
    result = run_cli("plugins")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["plugin", "distribution", "version", "spec", "kinds"]
    assert any(line.startswith("(core)") for line in lines)
    assert any(line.startswith("mamba ") for line in lines)
