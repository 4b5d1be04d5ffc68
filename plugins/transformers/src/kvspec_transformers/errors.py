"""The bridge's error type."""

from __future__ import annotations

from kvspec_core.errors import KVSpecError
from kvspec_transformers.generation import Generation


class EngineError(KVSpecError, RuntimeError):
    """The engine could not run a request (no blocks, a bad prompt, a model it cannot bind).

    Attributes:
        partial: when a request failed after generating tokens, what it had generated
            (``finish_reason`` ``"error"``); ``None`` otherwise.
    """

    partial: Generation | None = None
