"""Every plugin under ``plugins/`` is its own distribution, so each ships the license text: a
copy of the root LICENSE beside its pyproject (setuptools puts ``LICEN[CS]E*`` files in the
wheel's metadata), under the same license as the core. So does the example third-party plugin
under ``examples/``, which shows a plugin author what to declare."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_FOLDERS = sorted(
    path.parent
    for pattern in ("plugins/*/pyproject.toml", "examples/*/pyproject.toml")
    for path in ROOT.glob(pattern)
)


def project_table(pyproject: Path) -> dict:
    with pyproject.open("rb") as file:
        return tomllib.load(file)["project"]


def test_every_plugin_distribution_ships_the_root_license_text() -> None:
    assert len(PLUGIN_FOLDERS) >= 6, PLUGIN_FOLDERS
    root_text = (ROOT / "LICENSE").read_bytes()
    missing = [folder.name for folder in PLUGIN_FOLDERS if not (folder / "LICENSE").is_file()]
    assert missing == [], f"plugins without a LICENSE file: {missing}"
    differing = [
        folder.name for folder in PLUGIN_FOLDERS if (folder / "LICENSE").read_bytes() != root_text
    ]
    assert differing == [], f"plugin LICENSE files that differ from the root's: {differing}"


def test_every_plugin_declares_the_core_license() -> None:
    core_license = project_table(ROOT / "pyproject.toml")["license"]
    for folder in PLUGIN_FOLDERS:
        project = project_table(folder / "pyproject.toml")
        assert project["license"] == core_license, folder.name
        # An explicit license-files list would replace setuptools' default LICEN[CS]E* pattern.
        assert "LICENSE" in project.get("license-files", ["LICENSE"]), folder.name
