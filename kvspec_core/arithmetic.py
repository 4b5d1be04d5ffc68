"""Integer helpers shared by the sizing formulas; public, so plugins size their specs with the
same rounding as the core (``from kvspec_core.arithmetic import cdiv``)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return cdiv(value, multiple) * multiple
