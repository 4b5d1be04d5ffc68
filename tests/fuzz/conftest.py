"""Makes this folder's fuzzer modules (fuzz_hostile, fuzz_program, allocator_fuzz)
importable by its tests."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
