"""Fake installed distributions: real dist-info folders on sys.path, found by importlib-metadata."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

FakeDist = Callable[..., Path]


def write_distribution(
    root: Path, dist_name: str, entry_point: str, module: str, source: str, version: str = "1.0"
) -> Path:
    """Write ``module.py`` and ``<dist>-<version>.dist-info`` declaring a kvspec entry point."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n"
    )
    (info / "entry_points.txt").write_text(f"[kvspec.plugins]\n{entry_point} = {module}\n")
    return root


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeDist:
    """``fake_dist(dist_name, entry_point, module, source)``: install a fake distribution in a
    fresh folder prepended to sys.path for this test only."""
    counter = iter(range(1000))

    def make(
        dist_name: str, entry_point: str, module: str, source: str, version: str = "1.0"
    ) -> Path:
        root = write_distribution(
            tmp_path / f"site{next(counter)}", dist_name, entry_point, module, source, version
        )
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, module, raising=False)
        return root

    return make


_GOOD_PLUGIN = """
    import attrs, torch
    from typing import ClassVar
    from kvspec_core import FullAttentionSpec, hookimpl

    kvspec_contract_version = 1

    @attrs.frozen(kw_only=True)
    class WideSpec(FullAttentionSpec):
        kind: ClassVar[str] = "{kind}"

    @hookimpl
    def kvspec_register_spec_kinds(register):
        register(WideSpec)
"""


@pytest.fixture
def good_plugin() -> Callable[[str], str]:
    """Source of a well-behaved plugin registering one FullAttentionSpec subclass of ``kind``."""
    return lambda kind: _GOOD_PLUGIN.format(kind=kind)
