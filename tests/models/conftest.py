"""Makes ``model_testkit`` importable whatever pytest's import mode (``importlib`` does not put
test folders on ``sys.path``), and holds the fixtures the model tests share."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import transformers`` fail as it does where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "transformers", None)


@pytest.fixture(autouse=True, scope="session")
def model_code_cache_in_a_temporary_folder(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Keep the model-code readings these tests write out of the user's cache folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSPEC_CACHE_DIR", str(tmp_path_factory.mktemp("kvspec-cache")))
        yield
