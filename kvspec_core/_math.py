"""Integer helpers shared by the sizing formulas."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return cdiv(value, multiple) * multiple
