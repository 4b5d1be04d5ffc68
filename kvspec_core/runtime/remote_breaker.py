"""The circuit breaker of a remote server (``remote_server.py``): after a run of failed calls it
keeps calls from the server for a while, so that a server that is down costs the engine a
few failed calls, not one per call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Breaker:
    """Closed until ``failures_to_open`` failures in a row; then open for ``open_for_s``,
    after which one call tries (half open): success closes it, failure opens it again.
    ``clock`` is monotonic seconds."""

    failures_to_open: int
    open_for_s: float
    clock: Callable[[], float]
    failures_in_a_row: int = 0
    open_until: float | None = None

    def allows(self) -> bool:
        return self.open_until is None or self.clock() >= self.open_until

    def succeeded(self) -> None:
        self.failures_in_a_row = 0
        self.open_until = None

    def failed(self) -> bool:
        """Count a failure; True if the breaker opens now."""
        self.failures_in_a_row += 1
        half_open = self.open_until is not None
        if half_open or self.failures_in_a_row >= self.failures_to_open:
            self.open_until = self.clock() + self.open_for_s
            return True
        return False

    @property
    def is_open(self) -> bool:
        return self.open_until is not None and self.clock() < self.open_until
