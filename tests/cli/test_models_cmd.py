"""``kvspec models [--json]``: the presets and the families each needs."""

from __future__ import annotations

import json

import pytest

from kvspec_core.cli.main import main
from kvspec_core.cli.models_cmd import models_report
from kvspec_core.models.catalog import preset_names
from kvspec_core.plugins.manager import PluginManager


def test_json_lists_every_preset_with_its_families(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert list(models) == preset_names()
    assert models["jamba-1.5-mini"]["layer_types"] == {"mamba": 28, "full_attention": 4}
    assert models["jamba-1.5-mini"]["distributions"] == ["kvspec-mamba", "kvspec-core"]
    assert models["jamba-1.5-mini"]["spec_kinds"] == {"mamba": 28, "full_attention": 4}
    assert models["gpt-oss-20b"]["spec_kinds"] == {"sliding_window": 12, "full_attention": 12}
    assert models["deepseek-v2-lite"]["distributions"] == ["kvspec-mla"]
    assert models["llama-4-scout"]["distributions"] == ["kvspec-chunked-local", "kvspec-core"]
    assert models["whisper-large-v3"]["layer_types"] == {
        "encoder_only": 32,
        "full_attention": 32,
        "cross_attention": 32,
    }
    assert models["qwen3-8b"]["source"] == "Qwen/Qwen3-8B"
    assert all(m["error"] is None and m["missing_distributions"] == [] for m in models.values())


def test_without_plugins_the_missing_distributions_are_named() -> None:
    report = {m["name"]: m for m in models_report(PluginManager())["models"]}
    jamba = report["jamba-1.5-mini"]
    assert jamba["missing_distributions"] == ["kvspec-mamba"]
    assert jamba["spec_kinds"] == {} and "pip install kvspec-mamba" in jamba["error"]
    assert report["llama-3.1-8b"]["error"] is None


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == [
        "preset",
        "layer",
        "types",
        "spec",
        "kinds",
        "provided",
        "by",
    ]
    assert "nemotron-h-56b" in out and "mamba ×54, full_attention ×10" in out
    assert "CANNOT PLAN" not in out
