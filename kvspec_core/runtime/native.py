"""The compiled kernels (``_native``), or ``None`` where they are not built or not wanted.

``kvspec_core/runtime/_native_src/`` holds compiled twins of the runtime's per-block loops
(chained BLAKE2b block hashes, ...). They compute exactly what the Python code computes; the
install builds them when a C compiler is present. ``KVSPEC_PURE_PYTHON=1`` in the environment
(read at import) runs the pure-Python code even where they are built, e.g. to compare the two.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: Environment variable that, set to ``1``, turns the compiled kernels off.
PURE_PYTHON_ENV = "KVSPEC_PURE_PYTHON"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_PYTHON_ENV, "") == "1":
        return None
    try:
        # By full name: the package's __init__ imports the modules that import this one.
        return importlib.import_module("kvspec_core.runtime._native")
    except ImportError:
        return None


#: The compiled module, or ``None``: callers take their pure-Python path.
native: ModuleType | None = _load()
