"""Plugins and the example plugin use only kvspec-core's public modules and names: a private
(underscore) module or name may change in any release, so a plugin importing one would break
without its contract version changing."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def plugin_sources() -> list[Path]:
    """Every Python file of the family plugins (sources and tests) and the example plugin."""
    roots = [
        *sorted((REPO / "plugins").glob("*/src")),
        *sorted((REPO / "plugins").glob("*/tests")),
        *sorted((REPO / "examples").glob("*/src")),
    ]
    return [path for root in roots for path in sorted(root.rglob("*.py"))]


def private_core_imports(paths: Iterable[Path]) -> list[str]:
    """``"<file>:<line>: <what>"`` for every import of a private ``kvspec_core`` module (a
    dotted part starting with ``_``) or of a private name from a ``kvspec_core`` module,
    including imports inside functions."""
    found: list[str] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [node.module]
                imported += [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for dotted in imported:
                parts = dotted.split(".")
                if parts[0] == "kvspec_core" and any(part.startswith("_") for part in parts[1:]):
                    found.append(
                        f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}"
                        f":{node.lineno}: {dotted}"
                    )
                    break
    return found


def test_plugins_and_example_import_no_private_core_module() -> None:
    sources = plugin_sources()
    assert len(sources) > 20, sources  # the scan really sees the plugins
    assert private_core_imports(sources) == []


def test_private_import_scan_flags_each_private_form(tmp_path: Path) -> None:
    source = tmp_path / "plugin.py"
    source.write_text(
        "import kvspec_core._old\n"
        "from kvspec_core._old import cdiv\n"
        "from kvspec_core.specs import _helper, KVSpec\n"
        "from kvspec_core.arithmetic import cdiv as _cdiv\n"  # a private alias is the plugin's own
        "import kvspec_other._x\n"
        "def late():\n"
        "    from kvspec_core.runtime._internal import thing\n"
    )
    found = [line.split(": ", 1)[1] for line in private_core_imports([source])]
    assert found == [
        "kvspec_core._old",
        "kvspec_core._old",
        "kvspec_core.specs._helper",
        "kvspec_core.runtime._internal",
    ]
