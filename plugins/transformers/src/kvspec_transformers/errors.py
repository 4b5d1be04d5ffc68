"""The bridge's error type."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvspec_core.errors import KVSpecError

if TYPE_CHECKING:
    from kvspec_transformers.engine import Generation


class EngineError(KVSpecError, RuntimeError):
    """The engine could not run a request (no blocks, a bad prompt, a model it cannot bind).

    Attributes:
        partial: when a request failed after generating tokens, what it had generated
            (``finish_reason`` ``"error"``); ``None`` otherwise.
    """

    partial: Generation | None = None
