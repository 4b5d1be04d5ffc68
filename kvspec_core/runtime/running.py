"""What the allocator keeps per running request (``_Running``) and the ids it keys them by.

The compiled kernels read and write ``_Running``'s, ``Request``'s, ``Allocated``'s and
``CachedPrefix``'s ``__slots__`` fields in place (``_native_src/records.c``, registered
below at import): a field they name keeps its name and stays a slot.
"""

from __future__ import annotations

from kvspec_core.runtime.native import native
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import Allocated, CachedPrefix


def _is_id(request_id: object) -> bool:
    """Whether ``request_id`` is an exact str or int: what the allocator keys requests by.
    Looking another object up could run its ``__hash__`` / ``__eq__`` in the middle of a
    step (and a NaN is not equal to itself)."""
    kind = request_id.__class__
    return kind is str or kind is int


def _id_error(request_id: object, where: str = "") -> str:
    """Why ``request_id`` (not an exact str or int) is refused."""
    kind = request_id.__class__
    described = (
        repr(request_id)
        if kind is float or kind is bool or kind is bytes
        else f"<a {kind.__name__}>"
    )
    return (
        f"{where + ': ' if where else ''}request_id={described} must be a str or an int, not "
        f"{kind.__name__}; give each request a unique str (or int) id"
    )


class _Running:
    """Allocator-side state of one running request."""

    __slots__ = (
        "blocks",
        "cache_at",
        "computed",
        "computed_limit",
        "end_limit",
        "known_limit",
        "num_cached",
        "num_real",
        "num_skipped",
        "request",
    )

    def __init__(self, request: Request, computed: int, blocks: list[list[int]]) -> None:
        self.request = request
        self.computed = computed
        self.blocks = blocks
        count = len(blocks)
        self.num_skipped = [0] * count
        self.num_real = [len(table) - table.count(0) for table in blocks]
        self.num_cached = [0] * count
        self.cache_at = [0] * count
        self.end_limit = 0
        self.known_limit = 0
        self.computed_limit = 0


if native is not None:
    # The compiled steps read and write these records' slots in place (and know bare
    # requests); they build Allocated and CachedPrefix results without a Python call.
    native.register_types(_Running, Request, Allocated, CachedPrefix)
