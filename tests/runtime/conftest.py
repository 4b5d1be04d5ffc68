"""Makes this folder's helper module (runtime_testkit) importable by its tests."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402
from runtime_testkit import use_pure_python  # noqa: E402

from kvspec_core.runtime import native as _native_module  # noqa: E402


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every runtime test function runs twice: with the compiled kernels and with the
    # pure-Python code they mirror (both must give the same results). unittest-style
    # cases (the hypothesis state machine) and tests marked both_kernels (they compare the
    # two in one run) choose for themselves.
    if "runtime_kernels" in metafunc.fixturenames and not metafunc.definition.get_closest_marker(
        "both_kernels"
    ):
        metafunc.parametrize("runtime_kernels", ["native", "python"], indirect=True)


@pytest.fixture(autouse=True)
def runtime_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which implementation this test runs (see ``pytest_generate_tests``)."""
    kind = getattr(request, "param", "native")
    if kind == "native" and _native_module.native is None:
        if hasattr(request, "param"):
            pytest.skip("kvspec_core.runtime._native is not built (no C compiler at install)")
    elif kind == "python":
        use_pure_python(monkeypatch)
    return str(kind)
