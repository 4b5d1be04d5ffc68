"""The plugin as the core sees it: registration, the CLI, missing families, isolation."""

from __future__ import annotations

from pathlib import Path

import pytest
from mamba_testkit import manager_with_plugin

import kvspec_mamba.plugin as mamba_plugin
from kvspec_core import PluginManager
from kvspec_core.errors import MissingFamilyError
from kvspec_core.testing import kvspec_imports_outside, plugins_cli_report
from kvspec_mamba import MambaSpec

PLUGIN_ROOT = Path(__file__).resolve().parents[1]


def test_registering_into_a_fresh_manager_lists_the_kind() -> None:
    manager = PluginManager()
    info = manager.register(mamba_plugin, "mamba")
    assert info.spec_kinds == ("mamba",)
    assert {"kvspec_register_spec_kinds", "kvspec_layer_spec"} <= set(info.hooks)
    assert manager.spec_kinds.class_of("mamba") is MambaSpec
    assert manager.spec_kinds.owner_of("mamba") == "mamba"


def test_another_family_is_missing_and_named_with_its_install_line() -> None:
    manager = manager_with_plugin()
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mla"):
        manager.spec_kinds.class_of("mla_attention")
    with pytest.raises(MissingFamilyError, match="pip install kvspec-chunked-local"):
        manager.spec_kinds.class_of("chunked_local_attention")


def test_plugins_json_cli_lists_the_kind() -> None:
    report = plugins_cli_report("mamba")
    entries = {entry["name"]: entry for entry in report["plugins"]}
    assert entries["mamba"]["distribution"] == "kvspec-mamba"
    assert entries["mamba"]["spec_kinds"] == ["mamba"]
    assert "kvspec_layer_spec" in entries["mamba"]["hooks"]


def test_no_source_or_test_imports_another_family_plugin() -> None:
    paths = [path for path in PLUGIN_ROOT.rglob("*.py") if "build" not in path.parts]
    assert not kvspec_imports_outside(paths, {"kvspec_core", "kvspec_mamba"})
