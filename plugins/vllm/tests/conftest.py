"""kvspec-vllm's tests: this folder's helper modules importable, and the package itself where
it is not installed (the main .venv has no vLLM: the tests that need vLLM skip there, the
others run on the source)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for path in (_HERE, _HERE.parent / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
