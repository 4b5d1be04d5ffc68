"""Byte counts for people: one formatter shared by error messages and the CLI."""

from __future__ import annotations


def format_size(num_bytes: int | float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1 (``40.00 GiB``)."""
    if abs(num_bytes) < 1024:
        return f"{int(num_bytes)} B"
    value = float(num_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
    return f"{value:.2f} TiB"  # the largest unit, however many of them
