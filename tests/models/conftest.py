"""Makes ``model_testkit`` importable whatever pytest's import mode (``importlib`` does not put
test folders on ``sys.path``), and holds the fixtures the model tests share."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import transformers`` fail as it does where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "transformers", None)
