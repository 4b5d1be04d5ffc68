"""kvspec-hisparse as a plugin: registration, isolation, the CLI."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec_core import PluginManager
from kvspec_core.errors import MissingFamilyError

import kvspec_hisparse.plugin as hisparse_plugin
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
    env = {**os.environ, "KVSPEC_PLUGINS": "hisparse"}
    result = subprocess.run(
        [sys.executable, "-m", "kvspec_core", "plugins", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    report = json.loads(result.stdout)
    (entry,) = [plugin for plugin in report["plugins"] if plugin["name"] == "hisparse"]
    assert (entry["distribution"], entry["version"]) == ("kvspec-hisparse", "0.1.0")
    assert entry["spec_kinds"] == KINDS
    assert report["failed"] == []


def test_tests_and_sources_import_no_other_plugin() -> None:
    allowed = {"kvspec_core", "kvspec_hisparse"}
    sources = Path(hisparse_plugin.__file__).parent
    for path in [*Path(__file__).parent.glob("*.py"), *sources.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )
            for name in names:
                top = name.split(".")[0]
                assert not top.startswith("kvspec_") or top in allowed, f"{path.name}: {name}"
