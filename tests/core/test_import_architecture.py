"""The import architecture in pyproject.toml's ``[tool.importlinter]`` holds: the core's layers
(the plugin contract beneath the runtime and the planner), no import cycle in the core or in
any plugin package, the contract importing no runtime. import-linter checks it (``.ci/run``
runs ``lint-imports`` too); the second test shows that it counts the imports a cycle hides
behind (under ``TYPE_CHECKING``, inside a function)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_keeps_its_import_contracts(capsys: pytest.CaptureFixture[str]) -> None:
    exit_code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report
    assert "BROKEN" not in report and "5 kept, 0 broken" in report, report


@pytest.mark.parametrize(
    ("a_source", "cycle"),
    [
        ("from ringpkg.b import thing\n", True),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ringpkg.b import Hint\n",
            True,
        ),
        ("def later():\n    from ringpkg.b import thing\n", True),
        ("import os\n", False),
    ],
    ids=["plain", "type-checking", "deferred", "no-cycle"],
)
def test_a_cycle_is_found_however_its_import_is_hidden(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    a_source: str,
    cycle: bool,
) -> None:
    package = tmp_path / "ringpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(a_source)
    (package / "b.py").write_text("from ringpkg import a\nthing = Hint = 1\n")
    config = tmp_path / "contracts.toml"
    config.write_text(
        textwrap.dedent("""
        [tool.importlinter]
        root_package = "ringpkg"

        [[tool.importlinter.contracts]]
        name = "no cycles"
        type = "acyclic_siblings"
        ancestors = ["ringpkg"]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    exit_code = lint_imports(config_filename=str(config), no_cache=True)
    report = capsys.readouterr().out
    assert (exit_code != 0) == cycle, report
    if cycle:
        assert "No cycles are allowed in ringpkg" in report, report
