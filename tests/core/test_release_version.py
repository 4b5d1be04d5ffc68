"""One release number: ``kvspec_core/version.py``. kvspec-core's pyproject reads it; every
plugin repeats it as its version and pins the core (and sibling plugins) to exactly it, kept in
step by ``scripts/set-version``. These tests fail while any copy disagrees."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import importlib_metadata
import tomllib

import kvspec_core

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_PYPROJECTS = sorted(ROOT.glob("plugins/*/pyproject.toml"))


def read_toml(path: Path) -> dict:
    with path.open("rb") as file:
        return tomllib.load(file)


def test_the_core_takes_its_version_from_version_py() -> None:
    project = read_toml(ROOT / "pyproject.toml")
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "kvspec_core.version.__version__"}
    assert importlib_metadata.version("kvspec-core") == kvspec_core.__version__


def test_every_plugin_is_released_with_the_core_and_pins_it_exactly() -> None:
    assert len(PLUGIN_PYPROJECTS) >= 6
    for path in PLUGIN_PYPROJECTS:
        project = read_toml(path)["project"]
        assert project["version"] == kvspec_core.__version__, path
        pins = [dep for dep in project["dependencies"] if dep.startswith("kvspec-")]
        assert "kvspec-core==" + kvspec_core.__version__ in pins, path
        for pin in pins:
            assert pin.endswith("==" + kvspec_core.__version__), (path, pin)
        assert importlib_metadata.version(project["name"]) == kvspec_core.__version__, path


def copy_of_the_repository(tmp_path: Path, plugin_pyprojects: list[Path]) -> Path:
    """A folder holding what set-version reads: the script, version.py and the given plugin
    pyprojects (repository paths)."""
    copy = tmp_path / "repo"
    for path in [ROOT / "scripts" / "set-version", ROOT / "kvspec_core" / "version.py"]:
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    for path in plugin_pyprojects:
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True)
        shutil.copy(path, target)
    return copy


def test_set_version_rewrites_every_copy_and_refuses_a_bad_number(tmp_path: Path) -> None:
    copy = copy_of_the_repository(tmp_path, PLUGIN_PYPROJECTS)
    script = [sys.executable, str(copy / "scripts" / "set-version")]

    refused = subprocess.run([*script, "two"], capture_output=True, text=True)
    assert refused.returncode == 2
    assert (copy / "kvspec_core" / "version.py").read_text() == (
        ROOT / "kvspec_core" / "version.py"
    ).read_text()

    done = subprocess.run([*script, "9.8.7"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '__version__ = "9.8.7"' in (copy / "kvspec_core" / "version.py").read_text()
    for path in PLUGIN_PYPROJECTS:
        project = read_toml(copy / path.relative_to(ROOT))["project"]
        assert project["version"] == "9.8.7"
        for dep in project["dependencies"]:
            if dep.startswith("kvspec-"):
                assert re.fullmatch(r"kvspec-[a-z-]+==9\.8\.7", dep), dep


def test_set_version_writes_nothing_when_one_file_does_not_match(tmp_path: Path) -> None:
    copy = copy_of_the_repository(tmp_path, [])
    version_py = (ROOT / "kvspec_core" / "version.py").read_text()
    (copy / "plugins" / "odd").mkdir(parents=True)
    (copy / "plugins" / "odd" / "pyproject.toml").write_text('[project]\nname = "odd"\n')
    result = subprocess.run(
        [sys.executable, str(copy / "scripts" / "set-version"), "9.8.7"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "plugins/odd/pyproject.toml" in result.stderr
    assert (copy / "kvspec_core" / "version.py").read_text() == version_py
