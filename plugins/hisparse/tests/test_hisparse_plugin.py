"""kvspec-hisparse as a plugin: registration, isolation, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvspec_hisparse.plugin as hisparse_plugin
from kvspec_core import PluginManager
from kvspec_core.errors import MissingFamilyError
from kvspec_core.testing import kvspec_imports_outside, plugins_cli_report
from kvspec_hisparse import HiSparseGroupSpec, HiSparseHotSpec, HiSparseResidentSpec

KINDS = ["hisparse_group", "hisparse_hot", "hisparse_resident"]


def test_registration_lists_the_kinds() -> None:
    manager = PluginManager()
    info = manager.register(hisparse_plugin, "hisparse")
    assert list(info.spec_kinds) == KINDS
    assert info.hooks == ("kvspec_register_spec_kinds", "kvspec_register_runtime_rules")
    assert manager.spec_kinds.class_of("hisparse_hot") is HiSparseHotSpec
    assert manager.spec_kinds.class_of("hisparse_resident") is HiSparseResidentSpec
    assert manager.spec_kinds.class_of("hisparse_group") is HiSparseGroupSpec
    manager.unregister("hisparse")
    with pytest.raises(MissingFamilyError, match="pip install kvspec-hisparse"):
        manager.spec_kinds.class_of("hisparse_group")


def test_a_manager_without_mamba_names_its_distribution() -> None:
    manager = PluginManager()
    manager.register(hisparse_plugin, "hisparse")
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mamba"):
        manager.spec_kinds.class_of("mamba")


def test_plugins_cli_json_shows_the_kinds() -> None:
    report = plugins_cli_report("hisparse")
    (entry,) = [plugin for plugin in report["plugins"] if plugin["name"] == "hisparse"]
    assert (entry["distribution"], entry["version"]) == ("kvspec-hisparse", "0.1.0")
    assert entry["spec_kinds"] == KINDS
    assert report["failed"] == []


def test_tests_and_sources_import_no_other_plugin() -> None:
    allowed = {"kvspec_core", "kvspec_hisparse"}
    sources = Path(hisparse_plugin.__file__).parent
    paths = [*Path(__file__).parent.glob("*.py"), *sources.glob("*.py")]
    assert not kvspec_imports_outside(paths, allowed)
