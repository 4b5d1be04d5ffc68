"""Makes the CLI test kit importable here too (``importlib`` import mode puts no test folder
on ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "cli"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
