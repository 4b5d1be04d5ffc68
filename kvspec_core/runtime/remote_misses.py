"""The remote tier's memory of recent misses: block hashes the shared store answered it did
not have, so that a replica does not ask the server again and again for a prefix nobody
published (``remote_tier.py``).

Semantics (:class:`RecentMisses`):

* only an **answer** is remembered: the server said a hash is absent, or returned a value
  the store refused as corrupt. A call that failed, timed out or was kept from the server
  by the breaker says nothing about what the server holds and is never remembered;
* each entry **expires** ``ttl_s`` seconds after the miss (a monotonic clock): a block
  another replica publishes later is found by the first fetch after that, so a miss is
  never a miss for good. Within ``ttl_s`` a fetch ends its run before a remembered hash
  without asking (the price: a block published meanwhile is found up to ``ttl_s`` late);
* at most ``capacity`` entries: past that, the oldest are forgotten (forgetting only costs
  a question to the server);
* a hash this replica publishes itself is forgotten at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from kvspec_core.errors import AllocatorError

#: Seconds a miss is remembered by default.
DEFAULT_MISS_TTL_S = 1.0
#: Misses remembered at most by default (32-byte hashes: about 0.5 MiB with the dict).
DEFAULT_MISS_CAPACITY = 4096


class RecentMisses:
    """Block hashes the store answered it did not have, each until ``ttl_s`` after the miss,
    at most ``capacity`` of them (see the module docstring). ``ttl_s=0`` or ``capacity=0``
    remembers nothing."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_MISS_TTL_S,
        capacity: int = DEFAULT_MISS_CAPACITY,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, (int, float))
            or not (math.isfinite(ttl_s) and ttl_s >= 0)
        ):
            raise AllocatorError(f"miss_ttl_s={ttl_s!r} must be a finite number of seconds >= 0")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise AllocatorError(f"miss_capacity={capacity!r} must be an int >= 0")
        self.ttl_s = float(ttl_s)
        self.capacity = capacity
        self._clock = clock if clock is not None else time.monotonic
        # hash -> when it expires; insertion order is expiry order (one ttl for all, and a
        # hash missed again moves to the end).
        self._expiry: dict[bytes, float] = {}

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._expiry)

    def remember(self, hashes: Iterable[bytes]) -> int:
        """Remember ``hashes`` as missed now; returns how many were remembered."""
        if self.ttl_s == 0 or self.capacity == 0:
            return 0
        now = self._clock()
        self._expire(now)
        expiry = self._expiry
        count = 0
        for digest in hashes:
            expiry.pop(digest, None)
            expiry[digest] = now + self.ttl_s
            count += 1
        while len(expiry) > self.capacity:
            del expiry[next(iter(expiry))]
        return count

    def first_missed(self, hashes: Sequence[bytes]) -> int:
        """The index of the first of ``hashes`` remembered as missed (``len(hashes)`` if
        none is)."""
        expiry = self._expiry
        if not expiry:
            return len(hashes)
        self._expire(self._clock())
        return next((i for i, digest in enumerate(hashes) if digest in expiry), len(hashes))

    def remembers(self, digest: bytes) -> bool:
        """Whether ``digest`` is remembered as missed (and not expired)."""
        return self.first_missed((digest,)) == 0

    def forget(self, hashes: Iterable[bytes]) -> None:
        """Forget ``hashes`` (the store has them now)."""
        expiry = self._expiry
        if expiry:
            for digest in hashes:
                expiry.pop(digest, None)

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            digest = next(iter(expiry))
            if expiry[digest] > now:
                return
            del expiry[digest]
